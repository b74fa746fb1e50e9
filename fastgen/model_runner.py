"""Runs the model on one scheduled batch: flat metadata in, logits of the sampled rows out.

The runner owns the model and the KV-cache tensors; it is the only place that turns sequences
into the flat ragged tensors of `AttentionMetadata`.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from fastgen.block_manager import BlockManager
from fastgen.models.config import ModelConfig
from fastgen.ops import AttentionMetadata
from fastgen.sequence import Sequence


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of all layers for one block."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * itemsize


def available_memory(device: torch.device) -> int:
    """Free device memory (CUDA) or available RAM (CPU) in bytes."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    """Owns the model and its paged KV cache and executes scheduled batches."""

    def __init__(self, model: nn.Module, config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, attention_backend: str = "auto") -> None:
        if attention_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on {device.type} needs a CUDA GPU, or TRITON_INTERPRET=1 "
                             "set before the engine starts (the Triton interpreter, slow: for tests)")
        self.attention_backend = attention_backend
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]

    def prepare(self, chunks: list[tuple[Sequence, int]], block_manager: BlockManager):
        """Flat inputs of a batch: input_ids, positions, metadata, and the rows that get logits.

        A chunk gets logits only if it reaches the end of its sequence's known tokens (a prompt
        chunk in the middle of a prompt samples nothing).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        logits_indices: list[int] = []
        tables = []
        bs = self.block_size
        for seq, num_new in chunks:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            table = block_manager.block_table(seq.seq_id)
            tokens = seq.token_ids
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_new)
            tables.append(table)
            if end == seq.num_tokens:
                logits_indices.append(query_start_loc[-1] - 1)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(dev),
            block_tables=block_tables.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(dev),
            backend=self.attention_backend,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev)
        return ids, pos, md, torch.tensor(logits_indices, dtype=torch.int64).to(dev)

    @torch.inference_mode()
    def execute(self, chunks: list[tuple[Sequence, int]], block_manager: BlockManager) -> torch.Tensor:
        """Run one step; fp32 logits `[N, vocab]` for the chunks that end their sequence, in order."""
        ids, pos, md, logits_indices = self.prepare(chunks, block_manager)
        hidden = self.model(ids, pos, md, self.kv_caches)
        return self.model.compute_logits(hidden[logits_indices])
