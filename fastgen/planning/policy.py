"""The policy: from the model, the machine and the user's overrides, a `Plan` of how to serve it.

MII chose silently; fastgen chooses and says why. Every choice carries a one-line reason that
quotes the figure it rests on, and every choice can be overridden by the engine keyword of the
same name. The figures are FastGen's published defaults, rates measured on the CPU and GPU
machines fastgen is developed on (quoted beside each constant), and measurements quoted where they
are used. What sizes a step (token budget, attention charge, buckets, block size) is chosen in
`fastgen.planning.step_shape`; the choices of one concern each (CPU kernels, linears and compile, KV cache,
LM head, LoRA, offload, parallelism) in `fastgen.planning.choices`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Callable

import torch

from fastgen.models.quant import DEFAULT_GROUP_SIZE
from fastgen.planning.choices.cpu_kernels import (adaptive_threads_blocker, choose_adaptive_threads,
                                                  choose_cpu_attention, choose_decode_layer_kernel,
                                                  decode_layer_blocker, int4_kernel_reason, quantized_kernel_blocker)
from fastgen.planning.choices.kv_cache import choose_kv_memory, choose_kv_prefault
from fastgen.planning.choices.linears import (choose_compile, choose_gemv_weights, choose_weight_prepack,
                                              gemv_copy_bytes, kernel_tiles, prepack_blocker)
from fastgen.planning.choices.lm_head import choose_lm_head_quantization, q8_head_bytes
from fastgen.planning.choices.lora import choose_lora
from fastgen.planning.choices.offload import OFFLOAD_MAX_TOKEN_BUDGET, OffloadChoice, choose_offload
from fastgen.planning.choices.parallel import choose_replicas, choose_tensor_parallel_or_stream
from fastgen.planning.hardware import Hardware, detect_hardware
from fastgen.planning.memory import (activation_reserve, check_fits, choose_group_size, choose_quantization,
                                     divides_heads, kv_room, tp_candidates, weights_label)
from fastgen.planning.model_facts import ModelFacts, model_facts
from fastgen.planning.plan import PLAN_FIELDS, Plan, dtype_name, format_bytes, format_count, normalise_overrides
from fastgen.planning.speculative import (DEFAULT_GPU_HBM_GBPS, GPU_HBM_GBPS, SpeculativeConfig,
                                          choose_disable_by_batch_size, step_time_model)
from fastgen.planning.step_shape import (A100_BF16_TFLOPS, CPU_STEP_TARGET_S, CPU_WEIGHT_STREAM_GBPS_PER_CORE,
                                         FASTGEN_MAX_SEQS, FASTGEN_TOKEN_BUDGET, H200_BF16_TFLOPS, choose_block_size,
                                         choose_buckets, choose_context_charge, choose_token_budget, cpu_gflops,
                                         cpu_rates)

# A 768-token fp32 step of 30M params takes 0.25 s on this CPU; below that, precision costs no time.
TINY_FP32_PARAMS = 30_000_000


def make_plan(model: ModelFacts, hardware: Hardware, *, offline: bool = False, **overrides: Any) -> Plan:
    """Choose every `Plan` field for `model` on `hardware`; `overrides` (engine keywords) always win.

    `offline` says what the steps are judged by: False (serving) the streams' inter-token latency,
    True (a `pipeline` batch) the batch's total throughput; only the CPU token budget depends on it.

    A None override (or "auto") means "let the policy choose". An unknown keyword is a TypeError;
    an override this machine or model cannot honour is a ValueError naming the field and why.
    """
    user = normalise_overrides(overrides)
    _check_overrides_fit_hardware(user, model, hardware)
    cpu = hardware.device_type == "cpu"
    reasons: dict[str, str] = {}

    def pick(name: str, choose: Callable[[], tuple[Any, str]]) -> Any:
        if name in user:
            reasons[name] = "set by the user"
            return user[name]
        value, reasons[name] = choose()
        return value

    def reserve(tp: int) -> int:
        return activation_reserve(model, hardware, dtype, budget, max_seqs, tp)

    dtype = pick("dtype", lambda: _choose_dtype(model, hardware))
    attention = pick("attention_backend", lambda: _choose_attention(hardware))
    graphs = pick("cuda_graphs", lambda: _choose_cuda_graphs(model, hardware))
    if graphs and model.config.has_state:
        raise ValueError(f"cuda_graphs=True cannot serve {model.model_type}: {_NO_GRAPHS_FOR_STATE}")
    budget = pick("token_budget", lambda: choose_token_budget(model, hardware, dtype, offline))
    floor = max(max(user.get("buckets", (0,))), user.get("max_seqs", 0))
    if "token_budget" not in user and floor > budget:
        budget = floor
        reasons["token_budget"] = f"raised to {floor} to hold the buckets/max_seqs you set"
    context = pick("context_per_budget_token", lambda: choose_context_charge(model, offline))
    max_seqs = pick("max_seqs", lambda: (min(FASTGEN_MAX_SEQS, budget),
                                         f"FastGen's {FASTGEN_MAX_SEQS} sequences per step, at most token_budget "
                                         "(each scheduled sequence gets at least one token)"))
    buckets = pick("buckets", lambda: choose_buckets(hardware, budget))
    block_size = pick("block_size", lambda: choose_block_size(model))
    if buckets and buckets[-1] > budget:
        raise ValueError(f"token_budget {budget} is smaller than the largest bucket {buckets[-1]}: that bucket could never fill")
    if max_seqs > budget:
        raise ValueError(f"max_seqs {max_seqs} exceeds token_budget {budget}: each scheduled sequence needs a token")
    tps = [user["tensor_parallel"]] if "tensor_parallel" in user else tp_candidates(model, hardware)
    group = user.get("quantization_group_size", DEFAULT_GROUP_SIZE)
    quant = pick("quantization", lambda: _quantize_or_stream(model, hardware, dtype, group, tps, reserve, block_size,
                                                             user))
    weights, label = model.weight_bytes(dtype, quant, group), weights_label(dtype, quant)
    tp = pick("tensor_parallel", lambda: choose_tensor_parallel_or_stream(model, hardware, weights, label, reserve,
                                                                           user))
    if "tensor_parallel" in user and user.get("offload") == "none":
        check_fits(hardware, weights, label, tp, reserve(tp))
    state_slots = pick("state_slots", lambda: _choose_state_slots(model, dtype, tp, max_seqs))
    _check_state_slots(model, state_slots)
    group = pick("quantization_group_size", lambda: choose_group_size(model, quant, tp))
    if quant == "int4" and cpu:
        reasons["quantization"] += f"; {int4_kernel_reason(hardware, group)}"
    weights = model.weight_bytes(dtype, quant, group)
    replicas = pick("replica_num", lambda: choose_replicas(hardware, tp))
    if not cpu and tp * replicas > hardware.gpu_count * hardware.nodes:
        raise ValueError(f"tensor_parallel {tp} x replica_num {replicas} needs {tp * replicas} GPUs; "
                         f"this machine has {hardware.gpu_count}")
    stream = _choose_offload(model, hardware, dtype, quant, group, tp, reserve(tp), block_size, user)
    if stream.hide_tokens > budget and "token_budget" not in user:
        raised = min(OFFLOAD_MAX_TOKEN_BUDGET, 1 << (stream.hide_tokens - 1).bit_length())
        if raised > budget:
            reasons["token_budget"] += (f"; raised to {raised} for offload: each step streams "
                                        f"{format_bytes(stream.bytes_per_step)}, which compute hides from "
                                        f"~{stream.hide_tokens} tokens per step")
            budget = raised
            if "max_seqs" not in user:
                max_seqs = min(FASTGEN_MAX_SEQS, budget)
            if "buckets" not in user:
                buckets, reasons["buckets"] = choose_buckets(hardware, budget)
            stream = _choose_offload(model, hardware, dtype, quant, group, tp, reserve(tp), block_size, user)
    reasons["offload"] = "set by the user" if "offload" in user else stream.offload_reason
    blocker = prepack_blocker(hardware, dtype, quant, stream.offload)
    prepack = pick("weight_prepack", lambda: choose_weight_prepack(blocker))
    head_quant, reasons["lm_head_quantization"] = choose_lm_head_quantization(model, hardware, user, dtype, quant)
    if head_quant == "q8_0":  # beside the plain weight, which calls of many rows multiply
        weights += q8_head_bytes(model)
    if prepack:
        if blocker is not None:
            raise ValueError(f"weight_prepack=True cannot apply: {blocker}")
        if model.config.tie_word_embeddings and head_quant == "none":
            # The packed LM head (each rank's vocabulary rows) is a copy beside the embedding it was tied to.
            copy = model.head_weight_bytes(dtype)
            weights += copy
            reasons["weight_prepack"] += f"; the tied LM head's packed copy takes {format_bytes(copy)} more"
    gemv = pick("gemv_weights", lambda: choose_gemv_weights(model, hardware, dtype, prepack))
    tiles = gemv and kernel_tiles(hardware, dtype)  # the copies are the C++ GEMV kernels' tiles
    if gemv:
        if not prepack:
            raise ValueError("gemv_weights=True needs weight_prepack: without it every linear already keeps its "
                             "plain weight")
        copy = gemv_copy_bytes(model, dtype, tiles)
        weights += copy
        if "gemv_weights" in user:
            reasons["gemv_weights"] += f"; the copies take {format_bytes(copy)} more"
    reasons["weight_memory"] = stream.weight_memory_reason
    kernel_linears = cpu and quantized_kernel_blocker(hardware, quant, group) is None
    compile_mode = pick("compile", lambda: choose_compile(model, hardware, prepack, kernel_linears))
    if stream.offload != "none" and graphs:
        graphs = _without_graphs_for_offload(user, stream.offload, reasons)
    lora = choose_lora(model, user, dtype, tp, stream.offload)
    reasons.update(lora.reasons)
    if lora.enable_lora and graphs:
        reasons["cuda_graphs"] += ("; LoRA too: each token's adapter slot is a step input that the Triton LoRA kernels "
                                   "read on the GPU, so adapted steps replay like any other")
    if compile_mode == "off" and not graphs and "buckets" not in user:
        reasons["buckets"] += "; unused while compile is off and there are no CUDA graphs (steps run at exact shapes)"
    # With offload only weight_memory stays on the device; a "cpu" source on a CPU takes RAM besides.
    resident = weights if stream.offload == "none" else stream.weight_memory * tp
    room = kv_room(hardware, resident + (stream.host_bytes if cpu else 0), tp, reserve(tp))
    room -= state_slots * model.config.state_bytes_per_seq(dtype, tp) + lora.stack_bytes
    kv = choose_kv_memory(model, hardware, dtype, tp, room, max_seqs, block_size, user.get("kv_cache_memory"))
    reasons["kv_cache_memory"] = kv[1]
    spec = pick("speculative_config", lambda: (None, "off: no speculative_config given"))
    if spec is not None:
        spec, reasons["speculative_config"] = _choose_speculation(spec, model, hardware, dtype, quant, group, tp,
                                                                  max_seqs)
    grammar = pick("structured_outputs_backend", _choose_structured_outputs_backend)
    prefault = pick("kv_prefault", lambda: choose_kv_prefault(hardware))
    layer_blocker = decode_layer_blocker(attention, quant, tiles, tp, stream.offload, lora.enable_lora)
    decode_layer = pick("decode_layer_kernel", lambda: choose_decode_layer_kernel(layer_blocker))
    if decode_layer and layer_blocker is not None:
        raise ValueError(f"decode_layer_kernel=True cannot apply: {layer_blocker}")
    threads_blocker = adaptive_threads_blocker(hardware, compile_mode, tp)
    adaptive = pick("adaptive_threads", lambda: choose_adaptive_threads(threads_blocker))
    if adaptive and threads_blocker is not None:
        raise ValueError(f"adaptive_threads=True cannot apply: {threads_blocker}")
    reasons = {name: reasons[name] for name in PLAN_FIELDS}
    return Plan(dtype=dtype, quantization=quant, quantization_group_size=group, attention_backend=attention, compile=compile_mode, cuda_graphs=graphs,
                buckets=tuple(buckets), token_budget=budget, context_per_budget_token=context, max_seqs=max_seqs,
                block_size=block_size, state_slots=state_slots, kv_prefault=prefault,
                kv_cache_memory=kv[0], offload=stream.offload, weight_memory=stream.weight_memory,
                weight_prepack=prepack, gemv_weights=gemv, lm_head_quantization=head_quant,
                decode_layer_kernel=decode_layer, adaptive_threads=adaptive, tensor_parallel=tp,
                replica_num=replicas,
                speculative_config=spec, structured_outputs_backend=grammar, enable_lora=lora.enable_lora,
                max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank, max_cpu_loras=lora.max_cpu_loras,
                reasons=reasons)


# Decisions ------------------------------------------------------------------------------------


def _streams(user: dict[str, Any]) -> bool:
    """Whether the user asked for weight offload (a source, or a weight budget without offload='none')."""
    budget = user.get("weight_memory")
    return user.get("offload") in ("cpu", "disk") or (budget not in (None, 1.0) and user.get("offload") != "none")


def _quantize_or_stream(model: ModelFacts, hw: Hardware, dtype: torch.dtype, group: int, tps: list[int],
                        reserve: Callable[[int], int], block_size: int, user: dict[str, Any]) -> tuple[str, str]:
    """Quantization's choice, unless offload makes the weights fit anyway: offload streams them unchanged,
    so it comes before quantization when asked for, and after it (not even int4 fits) when not."""
    why = ("quantization changes outputs, so only on request (int8/int4 would also shrink the bytes streamed "
           "per step)")
    if _streams(user):
        return "none", f"offload is set: the weights need not fit the device; {why}"
    try:
        return choose_quantization(model, hw, dtype, group, tps, reserve, block_size)
    except ValueError:
        if user.get("offload") == "none":
            raise
        int4 = format_bytes(model.weight_bytes(dtype, "int4", group))
        return "none", f"not even int4 weights ({int4}) fit with the minimum KV cache: offload streams them; {why}"


def _choose_offload(model: ModelFacts, hw: Hardware, dtype: torch.dtype, quant: str, group: int, tp: int,
                    reserve: int, block_size: int, user: dict[str, Any]) -> OffloadChoice:
    """`choose_offload` with this device's matmul and host-copy rates."""
    if hw.device_type == "cpu":
        flops = cpu_gflops(hw, dtype_name(dtype)) * 1e9
    else:
        cc = min(g.compute_capability for g in hw.gpus)
        flops = (H200_BF16_TFLOPS if cc >= (9, 0) else A100_BF16_TFLOPS) * 1e12
    return choose_offload(model, hw, dtype, quant, group, tp, reserve, block_size, flops,
                          CPU_WEIGHT_STREAM_GBPS_PER_CORE * hw.cpu_cores, user)


def _choose_structured_outputs_backend() -> tuple[str, str]:
    """xgrammar when installed (masks precompiled per grammar state, so a step only looks them up: 12 ms
    to compile a nested schema, 0.01 ms a row's mask at the median, on 2 cores), else llguidance when
    installed."""
    if importlib.util.find_spec("xgrammar") is not None:
        return "xgrammar", ("xgrammar: token masks precompiled per grammar state (a step looks them up) and a CUDA "
                            "bitmask kernel; llguidance only for whitespace_pattern")
    if importlib.util.find_spec("llguidance") is not None:
        return "llguidance", "xgrammar is not installed; llguidance computes each step's mask without a precompile"
    return "xgrammar", "neither grammar library is installed: structured outputs are refused until xgrammar is"


def _without_graphs_for_offload(user: dict[str, Any], offload: str, reasons: dict[str, str]) -> bool:
    """No CUDA graphs under offload (False, with the reason); the user's cuda_graphs=True is a ValueError."""
    if user.get("cuda_graphs"):
        raise ValueError(f"offload={offload!r} needs cuda_graphs=False: layers stream between the layers' compute "
                         "(host waits, events, a copy thread), which a captured graph cannot contain")
    reasons["cuda_graphs"] = (f"off: offload={offload!r} streams weights between the layers' compute (host waits, "
                              "events, a copy thread), which a captured graph cannot replay; each layer still compiles")
    return False


def _choose_speculation(spec: SpeculativeConfig, model: ModelFacts, hw: Hardware, dtype: torch.dtype, quant: str,
                        group: int, tp: int, max_seqs: int) -> tuple[SpeculativeConfig, str]:
    """The user's speculative_config checked against the model (a draft model's vocabulary) and with the
    decode batch above which it stops paying (`choose_disable_by_batch_size`)."""
    if model.config.has_state:
        raise ValueError(f"speculative decoding is not implemented for {model.model_type}, a hybrid model: verifying "
                         "drafts advances each sequence's recurrent state over drafts that may be rejected, and "
                         "undoing that needs a state snapshot per draft position")
    draft = None
    if spec.method == "draft_model":
        draft = model_facts(spec.model)
        if draft.config.has_state:
            raise ValueError(f"speculative_config.model {spec.model!r} is a hybrid model ({draft.model_type}): a "
                             "draft model with recurrent-state layers is not implemented")
        if draft.vocab_size != model.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, "
                             f"the target {model.vocab_size}: a draft model must share the target's vocabulary")
    if hw.device_type == "cpu":
        flops, stream = cpu_gflops(hw, dtype_name(dtype)) * 1e9, CPU_WEIGHT_STREAM_GBPS_PER_CORE * hw.cpu_cores
        rates = f"matmuls at {flops / 1e9:.0f} GFLOP/s, weights streamed at {stream:.0f} GB/s"
    else:
        cc = min(g.compute_capability for g in hw.gpus)
        flops = (H200_BF16_TFLOPS if cc >= (9, 0) else A100_BF16_TFLOPS) * 1e12
        stream = next((rate for at_least, rate in sorted(GPU_HBM_GBPS.items(), reverse=True) if cc >= at_least),
                      DEFAULT_GPU_HBM_GBPS)
        rates = f"matmuls at {flops / 1e12:.0f} TFLOP/s, weights read at {stream / 1e3:.1f} TB/s"
    target = step_time_model(model.weight_bytes(dtype, quant, group), model.active_params, flops, stream)
    if draft is None:
        return choose_disable_by_batch_size(spec, target, lambda tokens: 0.0, max_seqs, rates)
    draft_quant = spec.quantization or "none"
    draft_time = step_time_model(draft.weight_bytes(dtype, draft_quant, group), draft.active_params, flops, stream)
    return choose_disable_by_batch_size(spec, target, draft_time, max_seqs, rates)


def _choose_state_slots(model: ModelFacts, dtype: torch.dtype, tp: int, max_seqs: int) -> tuple[int, str]:
    """One recurrent-state slot per sequence a step can hold, for a hybrid model; 0 otherwise."""
    if not model.config.has_state:
        return 0, "the model has no layer with a recurrent state"
    per_seq = model.config.state_bytes_per_seq(dtype, tp)
    layers = sum(1 for layer in model.config.layer_states if layer)
    return max_seqs, (f"one per sequence a step holds (max_seqs): {max_seqs} x {format_bytes(per_seq)} (the conv "
                      f"windows and fp32 state matrices of {layers} linear-attention layers) = "
                      f"{format_bytes(max_seqs * per_seq)} beside the KV cache. Prefix caching and sharing a "
                      "prompt's KV between the n choices of a request are off for this model: a sequence's state "
                      "exists only after its last computed token, so a cached block has none to resume from")


def _check_state_slots(model: ModelFacts, slots: int) -> None:
    """Refuse a state_slots override the model cannot use or cannot run with."""
    if model.config.has_state and slots < 1:
        raise ValueError(f"state_slots must be at least 1 for {model.model_type}: each running sequence of a hybrid "
                         "model needs one")
    if not model.config.has_state and slots:
        raise ValueError(f"state_slots must be 0 for {model.model_type}: it has no layer with a recurrent state")


def _choose_dtype(model: ModelFacts, hw: Hardware) -> tuple[torch.dtype, str]:
    """bf16 where it has fast matmuls; fp32 for tiny fp32 checkpoints; fp16 only where it is fast."""
    saved = model.dtype or torch.float32
    saved_name = dtype_name(saved) + ("" if model.dtype else " (unsaid: fp32)")
    if hw.device_type == "cpu":
        step = FASTGEN_TOKEN_BUDGET * 2 * model.active_params / (cpu_gflops(hw, "float32") * 1e9)
        if saved == torch.float32 and step <= CPU_STEP_TARGET_S / 2:
            return torch.float32, (f"checkpoint is {saved_name} and tiny: a {FASTGEN_TOKEN_BUDGET}-token fp32 step is "
                                   f"~{step:.2g} s here, so keep full precision")
        if saved == torch.float16 and "amx_fp16" in hw.cpu_flags:
            return torch.float16, "checkpoint is float16 and this CPU's AMX-FP16 runs it as fast as bf16"
        if {"avx512_bf16", "amx_bf16"} & hw.cpu_flags:
            return torch.bfloat16, (f"checkpoint is {saved_name}; matmul runs {cpu_rates(hw)}, and bf16 halves the "
                                    "bytes each decode step streams")
        return torch.float32, (f"checkpoint is {saved_name}; no AVX512-BF16/AMX here, so bf16 matmuls would be "
                               "emulated: fp32 is the fast dtype")
    cc = min(g.compute_capability for g in hw.gpus)
    if saved == torch.float32 and model.num_params < TINY_FP32_PARAMS:
        return torch.float32, (f"checkpoint is {saved_name} with {format_count(model.num_params)} params: a step is "
                               "launch-bound, so full precision costs nothing measurable")
    if cc < (8, 0):
        caution = "; a bf16 checkpoint's values past fp16's 65504 would overflow" if saved == torch.bfloat16 else ""
        return torch.float16, (f"checkpoint is {saved_name}; cc {cc[0]}.{cc[1]} has fp16 tensor cores but no bf16 "
                               f"(that starts at 8.0){caution}")
    if saved == torch.float16:
        return torch.float16, (f"checkpoint is float16: keep it unrounded; cc {cc[0]}.{cc[1]} runs fp16 and bf16 "
                               "tensor cores at the same rate")
    return torch.bfloat16, (f"checkpoint is {saved_name}; cc {cc[0]}.{cc[1]} has bf16 tensor cores at fp16's rate "
                            "and bf16 keeps fp32's range")


def _choose_attention(hw: Hardware) -> tuple[str, str]:
    """Triton on CUDA devices Triton supports (cc >= 8.0), fastgen's C++ kernel on CPUs that can build and
    run it, the torch reference elsewhere."""
    if hw.device_type == "cpu":
        return choose_cpu_attention(hw)
    cc = min(g.compute_capability for g in hw.gpus)
    if cc < (8, 0):
        return "torch", (f"cc {cc[0]}.{cc[1]}: Triton supports 8.0+, and since Triton 3.3 its tl.dot below 8.0 "
                         "compiles to FMA (no tensor cores)")
    return "triton", "one Triton launch serves mixed prefill+decode steps over the block tables"


_NO_GRAPHS_FOR_STATE = ("its linear-attention layers split each step's rows by their sizes on the host (decode "
                        "rows batched, prompt chunks scanned one by one), which a captured graph cannot replay")


def _choose_cuda_graphs(model: ModelFacts, hw: Hardware) -> tuple[bool, str]:
    """On for CUDA devices: small decode steps are launch-bound (not for hybrid models)."""
    if hw.device_type == "cpu":
        return False, "CUDA graphs exist only on CUDA devices"
    if model.config.has_state:
        return False, f"off for {model.model_type}: {_NO_GRAPHS_FOR_STATE}"
    return True, ("a small decode step is kernel-launch-bound (hundreds of launches per step); replaying one "
                  "captured graph per bucket removes that cost")


# Checks -----------------------------------------------------------------------------------------


def _check_overrides_fit_hardware(user: dict[str, Any], model: ModelFacts, hw: Hardware) -> None:
    """Raise ValueError for overrides this machine or model cannot honour."""
    cpu = hw.device_type == "cpu"
    if cpu and user.get("cuda_graphs"):
        raise ValueError("cuda_graphs=True needs a CUDA device; this plan is for the CPU")
    if cpu and user.get("attention_backend") == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("attention_backend='triton' on a CPU needs TRITON_INTERPRET=1 (the interpreter, ~1000x slower)")
    if not cpu and user.get("attention_backend") == "cpu":
        raise ValueError("attention_backend='cpu' is fastgen's C++ CPU kernel; this plan is for CUDA")
    if cpu and user.get("dtype") == torch.float16 and not {"avx512_fp16", "amx_fp16"} & hw.cpu_flags:
        raise ValueError("dtype float16 on a CPU without AVX512-FP16 or AMX-FP16: fp16 matmul runs ~3 GFLOP/s there, "
                         "~100x slower than bf16 (~410). Use bfloat16")
    if not cpu and user.get("dtype") == torch.bfloat16:
        cc = min(g.compute_capability for g in hw.gpus)
        if cc < (8, 0):
            raise ValueError(f"dtype bfloat16 needs compute capability >= 8.0; this GPU is {cc[0]}.{cc[1]}. Use float16")
    tp = user.get("tensor_parallel")
    if tp is not None:
        if not cpu and tp > hw.gpu_count * hw.nodes:
            raise ValueError(f"tensor_parallel {tp} is larger than the {hw.gpu_count * hw.nodes} GPU(s) here"
                             + (f" ({hw.nodes} machines)" if hw.nodes > 1 else ""))
        if cpu and tp > hw.cpu_cores:
            raise ValueError(f"tensor_parallel {tp} is larger than the {hw.cpu_cores} CPU cores here")
        if not divides_heads(model, tp):
            raise ValueError(f"tensor_parallel {tp} must divide the {model.num_heads} attention heads, and the "
                             f"{model.num_kv_heads} KV heads must divide by it or into it")


def plan_deployment(model_name_or_path: str, device: str | None = None, *, offline: bool = False,
                    **overrides: Any) -> Plan:
    """The plan for `model_name_or_path` on this machine (`device` as in `pipeline`; `offline` as in
    `make_plan`), without printing."""
    return make_plan(model_facts(model_name_or_path), detect_hardware(device), offline=offline, **overrides)


def explain(model_name_or_path: str, *, hardware: Hardware | None = None, offline: bool = False,
            **overrides: Any) -> Plan:
    """Plan how to serve `model_name_or_path` here (or on `hardware`), print it as a table, return it.

    Only config.json is read; `offline` is `make_plan`'s (True: the plan of a `pipeline` batch);
    `overrides` are the engine keywords the plan's fields are named after.
    """
    facts = model_facts(model_name_or_path)
    hardware = hardware or detect_hardware()
    plan = make_plan(facts, hardware, offline=offline, **overrides)
    print(f"model: {model_name_or_path} ({describe_model(facts)})")
    print(f"hardware: {describe_hardware(hardware)}")
    print(plan.table())
    return plan


def describe_model(model: ModelFacts) -> str:
    """One line: family, size, shape and saved dtype."""
    moe = f", {model.num_experts} experts ({format_count(model.active_params)} active)" if model.num_experts else ""
    saved = dtype_name(model.dtype) if model.dtype else "dtype unsaid"
    return (f"{model.model_type}, {format_count(model.num_params)} params{moe}, {model.num_layers} layers, "
            f"{model.num_heads} heads / {model.num_kv_heads} KV heads of {model.head_dim}, {saved}, "
            f"context {model.max_position_embeddings}")


def describe_hardware(hw: Hardware) -> str:
    """One line: the GPUs, or the CPU's cores, ISA and RAM."""
    cpu = (f"{hw.cpu_cores} CPU cores ({hw.cpu_capability}; {' '.join(sorted(hw.cpu_flags)) or 'no AVX'}), "
           f"{format_bytes(hw.ram_available)} RAM available")
    if hw.device_type == "cpu":
        return cpu
    g = hw.gpus[0]
    same = all(x.name == g.name for x in hw.gpus)
    name = f"{hw.gpu_count}x {g.name}" if same else ", ".join(x.name for x in hw.gpus)
    return (f"{name} (cc {g.compute_capability[0]}.{g.compute_capability[1]}, {g.sm_count} SMs, "
            f"{format_bytes(g.free_memory)} free of {format_bytes(g.total_memory)}); {cpu}")
