"""The model on its devices: the step contract (`HostStepInputs`, static buffers per bucket), the
`ModelRunner` (torch.compile per bucket, CUDA graphs, KV-cache tensors) and tensor-parallel ranks.

May import: `fastgen.models`, `fastgen.ops`; never the engine, planning, the public API or serving.
"""
