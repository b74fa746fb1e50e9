"""Runs the model on one scheduled batch: flat metadata in, logits of the sampled rows out.

The runner owns the model, the KV-cache tensors, the compiled decoder layer and (on CUDA) the
per-bucket CUDA graphs; it is the only place that knows about graphs. With buckets a step is padded
to the smallest bucket that holds it and a step larger than every bucket runs eagerly; without
(the CPU plan) every step runs at its exact size through one symbolic-shape compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from fastgen.models.config import ModelConfig
from fastgen.models.layers import decoder_layers
from fastgen.models.loader import LoadedModel, load_model
from fastgen.models.lora_layers import attach_lora
from fastgen.models.packed import prepack_linears
from fastgen.models.parallel import SINGLE, TensorParallel
from fastgen.models.q8_head import quantize_lm_head
from fastgen.models.registry import get_model_class
from fastgen.executor.compiled_layers import CompiledLayers
from fastgen.executor.decode_layers import install_decode_layers
from fastgen.executor.host_allocator import keep_host_temporaries
from fastgen.executor.offload import STREAMER_ATTR, install_offload, new_streamer
from fastgen.executor.step_inputs import HostStepInputs, StaticBuffers, StepTensors, pick_bucket
from fastgen.ops.cpu_kernels import prebuild
from fastgen.ops.cpu_kernels.q4 import CHUNK as Q4_CHUNK
from fastgen.ops.cpu_threads import ThreadGovernor
from fastgen.ops.kv_cache import allocate_kv_cache
from fastgen.ops.prefault import prefault_in_background
from fastgen.planning.plan import COMPILE_MODES, Plan

logger = logging.getLogger("fastgen")

@dataclass(frozen=True, slots=True)
class RunnerSpec:
    """Everything a `ModelRunner` is built from besides the model itself: the engine's `Plan` and the
    facts of this launch that a plan does not hold. Made once by the engine and sent as is (pickled
    once) to every tensor-parallel worker, so every rank builds the same runner."""

    plan: Plan
    """How the model is served: dtype, quantization, attention backend, compile, CUDA graphs, offload,
    weight memory, prepacking, block size and seats are the plan's fields, read from it (each is
    declared once, in `fastgen.planning.plan`)."""
    model_dir: str
    """Local checkpoint directory (workers load their own shard from it)."""
    device_type: str
    """"cpu" or "cuda"; on CUDA each rank uses its own device (see `rank_device`)."""
    device_index: int
    """CUDA device index of rank 0; spawned rank r uses `device_index + r`."""
    num_blocks: int
    """KV blocks per rank (each rank holds its KV heads of every block)."""
    max_model_len: int
    """Longest sequence (sizes the block tables)."""
    buckets: tuple[int, ...] = ()
    """Static step sizes to compile/capture, ascending: the plan's buckets where static shapes pay
    (compile, CUDA graphs, buckets a user named); empty: exact shapes."""
    num_threads: int = 0
    """CPU threads for a tensor-parallel worker (ranks share one machine's cores); 0 = leave as is."""
    progress: bool = False
    """Show a progress bar while compiling buckets."""


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V of all layers for one block, on this tensor-parallel rank, with the layers'
    caches as the model's family reads them (Gemma 4's KV-sharing layers own none)."""
    family_config = get_model_class(config.model_type).model_config(config)
    return block_size * family_config.kv_bytes_per_token(dtype)


def plan_kernels(plan: Plan) -> tuple[str, ...]:
    """The C++ CPU kernels (`fastgen.ops.cpu_kernels.KERNELS`) a CPU plan calls, which its runner builds side by
    side while the model loads (`prebuild`) rather than one after another at each one's first call."""
    wanted = {"paged_decode": plan.attention_backend == "cpu",
              "q4_matmul": plan.quantization == "int4" and plan.quantization_group_size % Q4_CHUNK == 0,
              "q8_matmul": plan.quantization == "int8" or plan.lm_head_quantization == "q8_0",
              "bf16_matmul": plan.gemv_weights and plan.dtype == torch.bfloat16,
              "f32_matmul": plan.gemv_weights and plan.dtype == torch.float32,
              "decode_layer": plan.decode_layer_kernel,
              "lora_delta": plan.enable_lora}
    return tuple(name for name, used in wanted.items() if used)


def load_for_spec(spec: RunnerSpec, device: torch.device, parallel: TensorParallel = SINGLE,
                  progress: bool = False) -> LoadedModel:
    """The model `spec` describes, loaded onto `device` (this rank's shard under `parallel`); with
    offload each decoder layer moves to the streamer's source as soon as it is loaded."""
    streamer = new_streamer(spec, device)
    plan = spec.plan
    if device.type == "cpu":  # the plan's C++ kernels build side by side while the weights load
        prebuild(plan_kernels(plan))
    loaded = load_model(spec.model_dir, dtype=plan.dtype, device=device, progress=progress, parallel=parallel,
                        quantization=plan.quantization, quantization_group_size=plan.quantization_group_size,
                        on_layer_loaded=streamer and streamer.adopt)
    if streamer is not None:
        setattr(loaded.model, STREAMER_ATTR, streamer)  # for install_offload in ModelRunner
    return loaded


EAGER_WARMUP_TOKENS = 1024
"""Largest all-padding step an eager CPU runner runs at start-up (its token budget, up to this), so that an
offline plan's large budget does not add seconds to start-up."""


class ModelRunner:
    """Owns the model and its paged KV cache and executes scheduled batches."""

    def __init__(self, model: nn.Module, config: ModelConfig, spec: RunnerSpec, device: torch.device) -> None:
        """Allocate the KV cache and static buffers on `device` and compile (and capture) every bucket."""
        self.spec = spec
        plan = spec.plan
        attention_backend, compile, cuda_graphs = plan.attention_backend, plan.compile, plan.cuda_graphs
        block_size, dtype, max_seqs = plan.block_size, plan.dtype, plan.max_seqs
        num_blocks, max_model_len, buckets, progress = spec.num_blocks, spec.max_model_len, spec.buckets, spec.progress
        if attention_backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"attention_backend='triton' on {device.type} needs a CUDA GPU, or TRITON_INTERPRET=1 "
                             "set before the engine starts (the Triton interpreter, slow: for tests)")
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {compile!r}")
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device, not {device.type}")
        if device.type == "cpu":
            keep_host_temporaries()
        if cuda_graphs and not buckets:
            raise ValueError("cuda_graphs need a bucket list (each bucket is one captured static shape)")
        self.attention_backend = attention_backend
        self.model = model
        # Before prepacking (which then packs each adapted linear's base) and compiling (which then takes
        # the adapter stacks as graph inputs).
        self.lora = attach_lora(model, plan.max_loras, plan.max_lora_rank, dtype, device) if plan.enable_lora else None
        """The model's LoRA linears, whose slots the engine's adapter manager fills (None: LoRA is off)."""
        if plan.lm_head_quantization == "q8_0":  # before prepacking, which would pack the head
            quantize_lm_head(model)
        if plan.weight_prepack:
            prepack_linears(model, gemv=plan.gemv_weights)
        self.offload = install_offload(model, spec, device)
        """The `WeightStreamer` of a model whose layers stream from offload (None: all resident)."""
        self.config = config
        self.block_size = block_size
        self.device = device
        self.buckets = sorted(set(buckets))
        self.compile_mode = compile
        self.cuda_graphs = cuda_graphs
        # The model's own config: its family decides each layer's cache (none for a layer that reads another's):
        # its K/V blocks, then the pools of whatever per-sequence state it keeps (a slot per sequence).
        self.kv_caches = [
            tuple(allocate_kv_cache(num_blocks, block_size, heads, width, dtype, device) for heads, width in shapes)
            + tuple(torch.zeros((plan.state_slots, *shape), dtype=state_dtype or dtype, device=device)
                    for shape, state_dtype in states)
            for shapes, states in zip(model.config.layer_kv_cache_shapes(), model.config.layer_state_shapes())
        ]
        if plan.kv_prefault:
            prefault_in_background([t for layer in self.kv_caches for t in layer])
        self.buffers = None
        if self.buckets:
            max_blocks_per_seq = -(-max_model_len // block_size)
            self.buffers = StaticBuffers(self.buckets[-1], min(self.buckets[-1], max_seqs), max_blocks_per_seq, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.warmup_seconds: dict[int, float] = {}
        self.compiled: CompiledLayers | None = None
        """The decoder layers' compiled graphs (None: compile is off)."""
        if compile != "off":
            self._compile_layers(compile)
        if plan.decode_layer_kernel and device.type == "cpu":  # in front of the compiled dispatch
            install_decode_layers(decoder_layers(model))
        if compile != "off" or cuda_graphs:
            self._warm_up(progress)
        elif device.type == "cpu" and attention_backend != "triton":  # the interpreter takes no padding step
            self._warm_up_eager(min(plan.token_budget, EAGER_WARMUP_TOKENS))
        self.threads = ThreadGovernor(len(os.sched_getaffinity(0))) if plan.adaptive_threads else None
        """Sets each step's CPU thread count from the other processes' CPU load (None: the plan's adaptive_threads
        is off)."""

    def _compile_layers(self, compile: str) -> None:
        """Regional compilation: each decoder layer runs through a compiled graph that the layers share
        (`CompiledLayers`). Without buckets one symbolic-shape graph serves every step size; with buckets
        (CUDA graphs) each bucket is one static specialisation. Embedding, final norm and logits stay
        eager: a few ops per step."""
        mode = "max-autotune-no-cudagraphs" if compile == "max-autotune" else None
        self.compiled = CompiledLayers(decoder_layers(self.model), dynamic=not self.buckets, mode=mode)

    def _forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        """The model step over the `StepTensors` as plain tensors (what torch.compile and CUDA graphs see)."""
        step = StepTensors(*tensors)
        return self.model(step.input_ids, step.positions, step.metadata(self.attention_backend), self.kv_caches)

    def _compile_context(self) -> contextlib.AbstractContextManager:
        """The symbolic-shape settings the layer graphs are traced and run under (none without compile)."""
        return self.compiled.context() if self.compiled is not None else contextlib.nullcontext()

    @torch.inference_mode()
    def _warm_up(self, progress: bool) -> None:
        """Compile (and capture) every shape serving will see now, so serving never compiles: each
        bucket, largest first; without buckets, two all-padding steps of different sizes (the first
        traces the symbolic graph, the second proves it serves another size)."""
        what = "compiling + capturing" if self.cuda_graphs else "compiling"
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        sizes = sorted(self.buckets, reverse=True) or [5, 1]
        for size in tqdm(sizes, desc=f"{what} {'buckets' if self.buckets else 'the decoder layer'}",
                         unit="shape", disable=not progress):
            start = time.perf_counter()
            if self.buckets:
                self.buffers.fill(None, size)
                views = self.buffers.views(size)
            else:
                views = HostStepInputs.padding(size, (size + 1) // 2).to_device(self.device)
            with self._compile_context():
                self._forward(*views)
            if self.cuda_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool), self._compile_context():
                    out = self._forward(*views)
                self._graphs[size] = (graph, out)
            self.warmup_seconds[size] = time.perf_counter() - start
            logger.info("fastgen: %d-token step ready in %.2f s (%s)", size, self.warmup_seconds[size], what)
        if self.compiled is not None:
            self.compiled.warmed_up()

    @torch.inference_mode()
    def _warm_up_eager(self, num_tokens: int) -> None:
        """One all-padding step of `num_tokens` tokens before the first request, on every rank: it faults in
        a full step's activations and creates oneDNN's primitives at that size, which a new server's first
        burst otherwise waits for (2-core EPYC, SmolLM2 bf16, 16 requests of ~600 tokens at once: first
        tokens after 1.6-2.7 s against 2.0-3.4 s; the step took 0.3 s at start-up)."""
        start = time.perf_counter()
        self._forward(*HostStepInputs.padding(num_tokens, 1).to_device(self.device))
        self.warmup_seconds[num_tokens] = time.perf_counter() - start

    @torch.inference_mode()
    def execute(self, host: HostStepInputs) -> torch.Tensor | None:
        """Run one step (the engine's scheduled chunks, flattened); fp32 logits `[N, vocab]` of the rows
        in `host.logits_indices`, in order (None on tensor-parallel ranks other than 0)."""
        if self.threads is None:
            return self._execute(host)
        self.threads.adjust()
        try:
            return self._execute(host)
        finally:
            self.threads.restore()

    def _execute(self, host: HostStepInputs) -> torch.Tensor | None:
        bucket = pick_bucket(self.buckets, host.num_tokens) if self.buckets else None
        if bucket is not None and bucket in self._graphs:
            self.buffers.fill(host, bucket)
            graph, hidden = self._graphs[bucket]
            graph.replay()
        else:
            if bucket is None:
                tensors = host.to_device(self.device)
            else:
                self.buffers.fill(host, bucket)
                tensors = self.buffers.views(bucket)
            # A step larger than every bucket runs eagerly rather than compile a shape mid-serving.
            eager = bucket is None and self.buckets and self.compile_mode != "off"
            with self.compiled.eager() if eager else self._compile_context():
                hidden = self._forward(*tensors)
        logits_indices = torch.tensor(host.logits_indices, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden[logits_indices])
