"""The C++ decode-layer op (`decode_layer.cpp`): a Llama block of a few-row CPU step in one call. Against the layer's
own forward on the same attention kernel (fp32 and bf16, int4 and Q8_0 linears, decode rows and short chunks of
mixed lengths in one step, a cache with NaNs beyond the valid slots), its K/V write, the engine's greedy tokens with
and without it, and the layers and plans it refuses with their reasons."""

from __future__ import annotations

import pytest
import torch

import fastgen
from fastgen.executor.decode_layers import step_of
from fastgen.models.loader import load_model
from fastgen.ops import AttentionMetadata
from fastgen.ops.cpu_kernels import ENV_VAR
from fastgen.ops.cpu_kernels.decode_layer import MAX_ROWS, DecodeLayerStep, DecodeLayerWeights, decode_layer_op
from fastgen.ops.kv_cache import allocate_kv_cache
from fastgen.planning.hardware import detect_hardware
from fastgen.planning.model_facts import model_facts
from fastgen.planning.policy import make_plan

BLOCK = 4


@pytest.fixture(autouse=True)
def _kernels(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    if decode_layer_op() is None:
        pytest.skip("the C++ CPU kernels cannot be built here")


def _step(chunks: list[tuple[int, int]], dtype: torch.dtype, kv_heads: int, head_dim: int, generator):
    """Metadata of a step whose sequences have (cached tokens, new tokens) `chunks`, each in its own blocks (given
    out in reverse, so no table is the identity), and one layer's K/V caches holding random cached tokens and NaN
    in every other slot."""
    blocks_of = [-(-(cached + new) // BLOCK) for cached, new in chunks]
    num_blocks = sum(blocks_of) + 2
    free = list(range(num_blocks - 1, -1, -1))
    tables = torch.zeros(len(chunks), max(blocks_of), dtype=torch.int32)
    caches = [allocate_kv_cache(num_blocks, BLOCK, kv_heads, head_dim, dtype, "cpu").fill_(float("nan"))
              for _ in range(2)]
    slots, positions, starts = [], [], [0]
    for s, ((cached, new), count) in enumerate(zip(chunks, blocks_of)):
        tables[s, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
        for pos in range(cached + new):
            slot = int(tables[s, pos // BLOCK]) * BLOCK + pos % BLOCK
            if pos < cached:
                for cache in caches:
                    cache[slot // BLOCK, slot % BLOCK] = torch.randn(kv_heads, head_dim, generator=generator)
            else:
                slots.append(slot)
                positions.append(pos)
        starts.append(starts[-1] + new)
    metadata = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=tables,
                                 seq_lens=torch.tensor([c + n for c, n in chunks], dtype=torch.int32),
                                 query_start_loc=torch.tensor(starts, dtype=torch.int32), backend="cpu")
    return metadata, torch.tensor(positions), caches


@pytest.mark.parametrize("model_type,quantization,dtype", [
    ("llama", "int4", torch.float32), ("llama", "int8", torch.float32), ("llama", "int4", torch.bfloat16),
    ("llama", "int8", torch.bfloat16), ("mistral", "int4", torch.bfloat16),  # a 12-token window, one KV head
    ("qwen2", "int4", torch.bfloat16), ("qwen3", "int8", torch.float32),  # q/k/v bias; per-head q/k RMSNorms
    ("smollm3", "int8", torch.bfloat16),  # NoPE layers: no rotary
], ids=lambda v: str(v).removeprefix("torch."))
def test_op_equals_the_layer_forward(tiny_checkpoints, model_type, quantization, dtype):
    """Decode rows and short chunks of mixed lengths in one step (a fresh prompt, a chunk over cached tokens, decode
    rows past a block boundary and past a sliding window): each layer's op output and K/V write against the layer's
    own forward, which calls the same attention and linear kernels, so only the glue between them differs."""
    model = load_model(tiny_checkpoints[model_type], dtype=dtype, progress=False, quantization=quantization,
                       quantization_group_size=64).model
    config = model.config
    generator = torch.Generator().manual_seed(0)
    chunks = [(0, 5), (7, 3), (13, 1), (4, 1), (30, 1)]
    hidden = (torch.randn(sum(n for _, n in chunks), config.hidden_size, generator=generator)).to(dtype)
    for layer in model.layers:
        weights = layer.decode_layer_weights()
        assert isinstance(weights, DecodeLayerWeights), weights
        metadata, positions, caches = _step(chunks, dtype, config.num_kv_heads, config.head_dim, generator)
        step = step_of(metadata, hidden)
        assert step is not None and step.kernel.every_row
        got_caches = [cache.clone() for cache in caches]
        got = step.run(weights, hidden, positions, got_caches, metadata.slot_mapping)
        want = type(layer).forward(layer, positions, hidden, metadata, caches)
        assert got.dtype == dtype and got.shape == want.shape
        # fp32: sums in another order (and an int8 rounding of x they may tip); bf16: one rounding step more.
        tol = 2e-3 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
        for got_cache, want_cache in zip(got_caches, caches):  # the step's slots written, no other touched
            assert torch.equal(got_cache.isnan(), want_cache.isnan())
            torch.testing.assert_close(got_cache, want_cache, equal_nan=True, rtol=tol, atol=tol)
        hidden = want


def test_steps_it_does_not_take(tiny_checkpoints):
    """A step larger than MAX_ROWS, and one with a prompt chunk the attention kernel leaves to torch, keep the
    layer's forward; so does the torch attention backend."""
    generator = torch.Generator().manual_seed(1)
    big, _, _ = _step([(0, 1)] * (MAX_ROWS + 1), torch.float32, 2, 16, generator)
    assert step_of(big, torch.zeros(MAX_ROWS + 1, 64)) is None
    long_chunk, _, _ = _step([(600, 600), (3, 1)], torch.float32, 2, 16, generator)
    assert step_of(long_chunk, torch.zeros(601, 64)) is None
    small, _, _ = _step([(3, 1)], torch.float32, 2, 16, generator)
    small.backend = "torch"
    assert step_of(small, torch.zeros(1, 64)) is None


def test_engine_greedy_with_the_op_equals_without(tiny_checkpoints, monkeypatch):
    """fp32 with Q8_0 linears, prompts of mixed lengths in one batch: the engine's greedy tokens through the op
    and through the layers' own forward (the parity suite checks that forward against HF; x's int8 rounding, which
    both share, keeps any quantized path from HF's exact tokens on this chaotic tiny model)."""
    path = tiny_checkpoints["llama"]
    prompts = [[5, 9, 23, 41, 7], [3, 17], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [8]]
    outputs, calls = {}, []
    run = DecodeLayerStep.run
    monkeypatch.setattr(DecodeLayerStep, "run", lambda self, *args: calls.append(1) or run(self, *args))
    for on in (True, False):
        pipe = fastgen.pipeline(path, dtype="float32", quantization="int8", decode_layer_kernel=on, progress=False)
        layer_forward = type(pipe.engine.runner.model.layers[0].forward).__name__
        assert (layer_forward == "_DecodeLayerForward") is on
        outputs[on] = [r.token_ids for r in pipe(prompts, max_new_tokens=12, do_sample=False, ignore_eos=True)]
        pipe.destroy()
        # the first step (19 prompt tokens) is too large; each of the 11 decode steps runs both layers through it
        assert len(calls) == (22 if on else 0)
        calls.clear()
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("model_type,quantization,group,reason", [
    ("qwen3", "int4", 32, "runs the int4_cpu kernel"),
    ("llama", "none", 64, "not an int4/int8/tiled linear"),
    ("granite", "int8", 64, "has its own forward"),  # residual and embedding multipliers
    ("olmo2", "int8", 64, "has no C++ decode-layer form"),  # post-norms
])
def test_layers_it_refuses_say_why(tiny_checkpoints, model_type, quantization, group, reason):
    from fastgen.executor.decode_layers import install_decode_layers

    model = load_model(tiny_checkpoints[model_type], dtype=torch.float32, progress=False, quantization=quantization,
                       quantization_group_size=group).model
    counts = install_decode_layers(model.layers)
    assert "" not in counts and any(reason in why for why in counts), counts


def test_a_bias_it_does_not_add_is_refused(tiny_checkpoints):
    model = load_model(tiny_checkpoints["llama"], dtype=torch.float32, progress=False, quantization="int8").model
    assert isinstance(model.layers[0].decode_layer_weights(), DecodeLayerWeights)
    model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.ones(model.config.hidden_size))
    assert "o_proj has a bias" in model.layers[0].decode_layer_weights()


def test_plan_chooses_and_refuses(tiny_checkpoints):
    facts, hardware = model_facts(tiny_checkpoints["llama"]), detect_hardware()
    on = make_plan(facts, hardware, dtype="float32", quantization="int4", quantization_group_size=64)
    assert on.decode_layer_kernel and "one C++ call" in on.reasons["decode_layer_kernel"]
    off = make_plan(facts, hardware, dtype="float32", gemv_weights=False)
    assert not off.decode_layer_kernel and "neither" in off.reasons["decode_layer_kernel"]
    torch_attention = make_plan(facts, hardware, quantization="int8", attention_backend="torch")
    assert not torch_attention.decode_layer_kernel
    with pytest.raises(ValueError, match="decode_layer_kernel=True cannot apply: .*tensor-parallel"):
        make_plan(facts, hardware, quantization="int8", tensor_parallel=2, decode_layer_kernel=True)


def test_engine_with_the_op_under_compile_preemption_and_prefix_hits(tiny_checkpoints, monkeypatch):
    """The op beside the compiled layers (the larger steps), with a KV cache small enough to force preemption
    (recomputed sequences re-enter as prompt chunks, then decode through the op again) and prompts sharing a
    prefix (cached blocks the op reads in place): the same greedy tokens as with the op off. fp32, Q8_0 linears:
    the two paths agree to ~1e-7 a layer, so only a rare tipped int8 rounding of x may part them late."""
    from test_engine_parity import _workload

    from fastgen import EngineConfig, SamplingParams
    from fastgen.engine import Engine
    from kit import run_to_end

    calls = []
    run = DecodeLayerStep.run
    monkeypatch.setattr(DecodeLayerStep, "run", lambda self, *args: calls.append(1) or run(self, *args))
    outputs = {}
    for on in (True, False):
        engine = Engine.from_config(EngineConfig(
            model=tiny_checkpoints["llama"], dtype="float32", quantization="int8", compile="default",
            decode_layer_kernel=on, num_kv_blocks=40, block_size=4, token_budget=16, max_seqs=8, progress=False))
        engine.eos_token_ids = set()
        prompts = _workload(engine.tokenizer)
        seqs = run_to_end(engine, prompts, SamplingParams(do_sample=False, max_new_tokens=12), max_steps=2000)
        assert sum(s.num_preemptions for s in seqs) > 0 and sum(s.num_cached_prompt_tokens for s in seqs[-4:]) > 0
        assert engine.block_manager.num_free_blocks == 40
        assert bool(calls) is on
        calls.clear()
        outputs[on] = [s.output_token_ids for s in seqs]
    assert all(a[:4] == b[:4] for a, b in zip(outputs[True], outputs[False]))
    pairs = [(x, y) for a, b in zip(outputs[True], outputs[False]) for x, y in zip(a, b)]
    assert sum(x == y for x, y in pairs) >= 0.9 * len(pairs)
