"""fastgen's own C++ CPU kernels: compiled at first use by torch's extension toolchain, cached under
`$FASTGEN_CACHE`, one build per ISA variant picked at run time (`isa`), and the torch path wherever they
cannot run. Today: paged attention of short queries (decode rows, verification rows) over the blocked
KV cache, with the step's KV write (`decode`, `paged_decode.cpp`), the LoRA delta of mixed-adapter rows
(`lora`, `lora_delta.cpp`), and products with int8 (Q8_0) and int4 weights whose x is quantized to int8 too,
as llama.cpp computes them (`q8`, `q8_matmul.cpp`; `q4`, `q4_matmul.cpp`), bf16 products of a few rows (`bf16`,
`bf16_matmul.cpp`), and a whole decoder layer of a decode step (`decode_layer`, `decode_layer.cpp`). Each kernel
is a library of its own, built when a plan first uses it (`build`)."""

from fastgen.ops.cpu_kernels.build import KERNELS, active_op, build_dir, kernel_op, kernels_dir, prebuild
from fastgen.ops.cpu_kernels.decode import MAX_QUERY_LEN, KernelStep, plan_kernel_step
from fastgen.ops.cpu_kernels.lora import cpu_lora_delta
from fastgen.ops.cpu_kernels.isa import (ENV_VAR, ISA_NOTES, ISAS, cpu_kernel_isa, isas_from_flags, pick_isa,
                                         requested_isa, supported_isas)

__all__ = ["ENV_VAR", "ISAS", "ISA_NOTES", "KERNELS", "MAX_QUERY_LEN", "KernelStep", "active_op", "build_dir",
           "cpu_kernel_isa", "cpu_lora_delta", "isas_from_flags", "kernel_op", "kernels_dir", "pick_isa",
           "plan_kernel_step", "prebuild", "requested_isa", "supported_isas"]
