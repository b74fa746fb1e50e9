"""Hand-written operations: paged attention over the blocked KV cache and the KV-cache write."""

from fastgen.ops.attention_metadata import AttentionMetadata
from fastgen.ops.paged_attention import attention, paged_attention, write_kv_cache

__all__ = ["AttentionMetadata", "attention", "paged_attention", "write_kv_cache"]
