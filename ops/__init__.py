"""Hand-written operations: paged attention over the blocked KV cache (with attention sinks; its decode rows
also as fastgen's own C++ CPU kernel, `fastgen.ops.cpu_kernels`, built at first use), MLA's latent
attention over a latent cache (`fastgen.ops.latent_attention`), the KV cache's layout and write
(`fastgen.ops.kv_cache`), the CPU linear over oneDNN-prepacked weights (`fastgen.ops.packed_linear`) and
the few-row linear that splits a weight's output rows over the cores (`fastgen.ops.gemv`)."""

from fastgen.ops.attention_metadata import AttentionMetadata
from fastgen.ops.kv_cache import allocate_kv_cache, gather_blocks, write_kv_cache
from fastgen.ops.latent_attention import latent_attention, torch_latent_attention
from fastgen.ops.paged_attention import (
    attention,
    cpu_paged_attention,
    paged_attention,
    torch_paged_attention,
    paged_attention_cpu,
    paged_attention_torch,
    paged_attention_triton,
)
from fastgen.ops.triton_attention import triton_paged_attention, triton_write_kv_cache

__all__ = [
    "AttentionMetadata",
    "allocate_kv_cache",
    "gather_blocks",
    "attention",
    "cpu_paged_attention",
    "latent_attention",
    "torch_latent_attention",
    "paged_attention",
    "paged_attention_cpu",
    "torch_paged_attention",
    "paged_attention_torch",
    "paged_attention_triton",
    "triton_paged_attention",
    "triton_write_kv_cache",
    "write_kv_cache",
]
