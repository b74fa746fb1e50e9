"""The KV cache's share of the memory the weights and activations leave (`kv_cache_memory`), and whether its
pages are mapped before the first steps write them (`kv_prefault`)."""

from __future__ import annotations

import torch

from fastgen.ops.prefault import prefault_supported
from fastgen.planning.hardware import Hardware
from fastgen.planning.memory import CPU_KV_RAM_FRACTION, GPU_MEMORY_FRACTION
from fastgen.planning.model_facts import ModelFacts
from fastgen.planning.plan import format_bytes

def choose_kv_prefault(hw: Hardware) -> tuple[bool, str]:
    """Off by default: measured to gain nothing where a run touches a small share of the cache."""
    if hw.device_type != "cpu":
        return False, "device memory is mapped when it is allocated: no page faults in the steps"
    if not prefault_supported():
        return False, "this OS does not take madvise(MADV_POPULATE_WRITE) (Linux 5.14+): pages fault at first write"
    return False, ("off: a step faults only on the pages it writes first, ~50 ms over a 128-request run's 84 MB of "
                   "KV, while mapping the whole cache at start-up competes with the first steps (2-core EPYC, "
                   "SmolLM2 bf16, 1 GiB cache: 864 tok/s without, 844 with); kv_prefault=True for caches a "
                   "long-context workload fills")


def choose_kv_memory(model: ModelFacts, hw: Hardware, dtype: torch.dtype, tp: int, room: int,
                      max_seqs: int, block_size: int, user: int | float | None) -> tuple[int, str]:
    """Bytes of KV cache per device: a share of what the weights and activations leave."""
    per_token = model.kv_bytes(dtype, tp)
    where = "RAM available" if hw.device_type == "cpu" else f"{GPU_MEMORY_FRACTION} of free GPU memory"
    if isinstance(user, float):
        kv, why = int(room * user), f"set by the user: {user} of the {format_bytes(room)} left after weights and activations"
    elif isinstance(user, int):
        if user > room:
            raise ValueError(f"kv_cache_memory {format_bytes(user)} exceeds the {format_bytes(room)} of {where} left after "
                             "weights and activations")
        kv, why = user, "set by the user"
    else:
        full_len = -(-model.max_position_embeddings // block_size) * block_size
        useful = max_seqs * full_len * per_token
        share = CPU_KV_RAM_FRACTION if hw.device_type == "cpu" else 1.0
        kv = min(int(room * share), useful)
        what = (f"{CPU_KV_RAM_FRACTION} of the {format_bytes(room)} of RAM left after weights and activations (shared machine)"
                if hw.device_type == "cpu" else f"{where} minus weights and activations")
        capped = f", capped at {max_seqs} full-length sequences" if kv == useful else ""
        why = f"{what}{capped}: {kv // per_token:,} tokens at {per_token:,} B/token{_sliding_layers_note(model)}"
    if kv < block_size * per_token:
        raise ValueError(f"kv_cache_memory {kv} bytes holds no {block_size}-token block ({block_size * per_token} bytes)")
    return kv, why


def _sliding_layers_note(model: ModelFacts) -> str:
    """What the B/token of a model with sliding-window layers counts: their K/V of every token, as the
    runner allocates it (one block table serves all layers, so a block holds every layer's K/V)."""
    windows = [w for w in model.config.layer_sliding_windows if w]
    if not windows:
        return ""
    sizes = "/".join(str(w) for w in sorted(set(windows)))
    return (f"; its sliding-window layers ({len(windows)} of {model.num_layers}, window {sizes}) are cached in "
            "full, every token, as the full layers are: prefix-cache hits and preemption's recompute reuse whole "
            "blocks of all layers, so no block is freed once it falls outside the window (freeing those is a follow-up)")
