"""The policy's choices one concern at a time, each with the reason it quotes: the CPU kernels
(`cpu_kernels`), how the linears run and whether Inductor compiles (`linears`), the KV cache's size and
first touch (`kv_cache`), the LM head's Q8_0 (`lm_head`), LoRA (`lora`), weight offload (`offload`), and
tensor parallelism and replicas (`parallel`). `fastgen.planning.policy.make_plan` calls them in order.

May import: `fastgen.planning`'s leaf modules (hardware, model facts, memory, plan, step shape),
`fastgen.models`, `fastgen.ops`; never `fastgen.planning.policy`.
"""
