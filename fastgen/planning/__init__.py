"""How to serve a model on a machine: `Plan` (one engine keyword per field, each with a reason),
`make_plan` (the policy), the hardware probe and the model facts it reads. `python -m
fastgen.planning MODEL` prints the plan.

May import: `fastgen.models`; never the engine, the executor, the public API or serving.
"""
