"""One step's execution, between `Scheduler.schedule` and `Scheduler.update`: the batch flattened
into the executor's inputs (`inputs.py`), the model run with failing requests isolated
(`executor.py`), sampling (`sampler.py` on the step's per-row tensors from `sampling_metadata.py`,
glued to the sequences by `row_sampling.py`), and the result keyed by sequence (`output.py`:
`StepOutput`, `SequenceUpdate`, `RequestFailed`)."""
