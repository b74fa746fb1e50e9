"""Runs the model on one scheduled batch: flat metadata in, logits of the sampled rows out.

The runner owns the model, the KV-cache tensors, the per-bucket compiled steps and (on CUDA)
the per-bucket CUDA graphs; it is the only place that knows about graphs. A step is padded to
the smallest bucket that holds it; a step larger than every bucket runs eagerly.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from fastgen.models.config import ModelConfig
from fastgen.models.loader import LoadedModel, load_model
from fastgen.models.parallel import SINGLE, TensorParallel
from fastgen.executor.step_inputs import HostStepInputs, StaticBuffers, StepTensors, pick_bucket

logger = logging.getLogger("fastgen")

COMPILE_MODES = ("off", "default", "max-autotune")
"""`compile` settings: no torch.compile; Inductor's default; Inductor with autotuned kernels."""


@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """Everything a `ModelRunner` is built from besides the model itself: made once by the engine
    from its plan, and sent as is (pickled once) to every tensor-parallel worker, so every rank
    builds the same runner."""

    model_dir: str
    """Local checkpoint directory (workers load their own shard from it)."""
    dtype: torch.dtype
    """Weights and KV-cache dtype."""
    device_type: str
    """"cpu" or "cuda"; on CUDA each rank uses its own device (see `rank_device`)."""
    device_index: int
    """CUDA device index of rank 0; spawned rank r uses `device_index + r`."""
    num_blocks: int
    """KV blocks per rank (each rank holds its KV heads of every block)."""
    block_size: int
    """Tokens per KV block."""
    max_model_len: int
    """Longest sequence (sizes the block tables)."""
    max_seqs: int = 1
    """Sequences per step."""
    quantization: str = "none"
    """Weight-only quantization of the decoder linears ("none", "int8", "int4"): each rank quantizes
    its own shard as it loads it (`load_model`)."""
    quantization_group_size: int = 128
    """Input features per int4 scale and zero."""
    attention_backend: str = "torch"
    """"torch" or "triton"."""
    buckets: tuple[int, ...] = ()
    """Static step sizes to compile/capture, ascending (empty: exact shapes, eager)."""
    compile: str = "off"
    """torch.compile mode of the step, one of `COMPILE_MODES`."""
    cuda_graphs: bool = False
    """Capture each bucket once as a CUDA graph (CUDA only)."""
    num_threads: int = 0
    """CPU threads for a tensor-parallel worker (ranks share one machine's cores); 0 = leave as is."""
    progress: bool = False
    """Show a progress bar while compiling buckets."""


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of all layers for one block, on this tensor-parallel rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_heads = config.parallel.kv_heads(config.num_kv_heads)
    return 2 * config.num_layers * block_size * kv_heads * config.head_dim * itemsize


def load_for_spec(spec: RunnerSpec, device: torch.device, parallel: TensorParallel = SINGLE,
                  progress: bool = False) -> LoadedModel:
    """The model `spec` describes, loaded onto `device` (this rank's shard under `parallel`)."""
    return load_model(spec.model_dir, dtype=spec.dtype, device=device, progress=progress, parallel=parallel,
                      quantization=spec.quantization, quantization_group_size=spec.quantization_group_size)


class ModelRunner:
    """Owns the model and its paged KV cache and executes scheduled batches."""

    def __init__(self, model: nn.Module, config: ModelConfig, spec: RunnerSpec, device: torch.device) -> None:
        """Allocate the KV cache and static buffers on `device` and compile (and capture) every bucket."""
        self.spec = spec
        attention_backend, compile, cuda_graphs, buckets = (spec.attention_backend, spec.compile, spec.cuda_graphs,
                                                            spec.buckets)
        num_blocks, block_size, dtype = spec.num_blocks, spec.block_size, spec.dtype
        max_seqs, max_model_len, progress = spec.max_seqs, spec.max_model_len, spec.progress
        if attention_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on {device.type} needs a CUDA GPU, or TRITON_INTERPRET=1 "
                             "set before the engine starts (the Triton interpreter, slow: for tests)")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {device.type}")
        if (compile != "off" or cuda_graphs) and not buckets:
            raise ValueError("compile and cuda_graphs need a bucket list (static shapes)")
        self.attention_backend = attention_backend
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.buckets = sorted(set(buckets))
        self.compile_mode = compile
        self.cuda_graphs = cuda_graphs
        shape = (num_blocks, block_size, config.parallel.kv_heads(config.num_kv_heads), config.head_dim)
        # Uninitialised: attention never reads a slot before this step's K/V is written there (stale
        # slots are masked and zeroed in the gathered copy), and zeroing gigabytes of cache cost
        # start-up time (1.2M page faults for the 93M benchmark model's cache on this CPU).
        self.kv_caches = [
            (torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        self.buffers = None
        if self.buckets:
            max_blocks_per_seq = -(-max_model_len // block_size)
            self.buffers = StaticBuffers(self.buckets[-1], min(self.buckets[-1], max_seqs), max_blocks_per_seq, device)
        self._compiled = None
        if compile != "off":
            # One code object serves every bucket; each bucket is one static-shape specialisation.
            mode = "max-autotune-no-cudagraphs" if compile == "max-autotune" else None
            self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False, mode=mode)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warmup_seconds: dict[int, float] = {}
        self._recompile_limit = 0
        if compile != "off" or cuda_graphs:
            # Dynamo counts specialisations per code object, and every runner in this process
            # (earlier pipelines of a notebook, other tests) shares `_forward`'s, so their entries
            # count too. Counted once here, not per step. Imported here: torch._dynamo costs ~1.3 s
            # of import time that a compile-off start-up never needs.
            from torch._dynamo.eval_frame import _debug_get_cache_entry_list

            others = len(_debug_get_cache_entry_list(ModelRunner._forward.__code__))
            self._recompile_limit = others + len(self.buckets) + 8
            self._warm_up(progress)

    def _forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        """The model step over the `StepTensors` as plain tensors (what torch.compile and CUDA graphs see)."""
        step = StepTensors(*tensors)
        return self.model(step.input_ids, step.positions, step.metadata(self.attention_backend), self.kv_caches)

    def _recompile_budget(self):
        """Dynamo's recompile limit, raised for this call only: every bucket is one specialisation."""
        limit = self._recompile_limit
        return torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, 4 * limit))

    @torch.inference_mode()
    def _warm_up(self, progress: bool) -> None:
        """Compile (and capture) every bucket now, largest first, so serving never compiles."""
        what = "compiling + capturing" if self.cuda_graphs else "compiling"
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        for bucket in tqdm(sorted(self.buckets, reverse=True), desc=f"{what} buckets", unit="bucket",
                           disable=not progress):
            start = time.perf_counter()
            self.buffers.fill(None, bucket)
            views = self.buffers.views(bucket)
            step = self._compiled or self._forward
            with self._recompile_budget():
                step(*views)
            if self.cuda_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), self._recompile_budget():
                    out = step(*views)
                self._graphs[bucket] = (graph, out)
            self.warmup_seconds[bucket] = time.perf_counter() - start
            logger.info("fastgen: bucket %d tokens ready in %.2f s (%s)", bucket, self.warmup_seconds[bucket], what)

    @torch.inference_mode()
    def execute(self, host: HostStepInputs) -> torch.Tensor | None:
        """Run one step (the engine's scheduled chunks, flattened); fp32 logits `[N, vocab]` of the rows
        in `host.logits_indices`, in order (None on tensor-parallel ranks other than 0)."""
        bucket = pick_bucket(self.buckets, host.num_tokens) if self.buckets else None
        if bucket is None:
            hidden = self._forward(*host.to_device(self.device))
        else:
            self.buffers.fill(host, bucket)
            if bucket in self._graphs:
                graph, out = self._graphs[bucket]
                graph.replay()
                hidden = out
            elif self._compiled is not None:
                with self._recompile_budget():
                    hidden = self._compiled(*self.buffers.views(bucket))
            else:
                hidden = self._forward(*self.buffers.views(bucket))
        logits_indices = torch.tensor(host.logits_indices, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[logits_indices])
