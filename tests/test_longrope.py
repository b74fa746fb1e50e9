"""LongRoPE exactly as Hugging Face computes it, through the engine: prompts on both sides of
`original_max_position_embeddings`, generation across it, chunked prefill, preemption and prefix
caching, several prompts per batch, against HF's greedy generation.

HF picks the long factors per forward pass, for all of a sequence longer than `original_max`. Its
Phi-3 generation also drops the KV cache when a sequence first outgrows it and recomputes every
token with the long factors; its generic LongRoPE (here on a Llama) keeps the cached tokens' factors.
"""

import pytest

import fastgen
from fastgen.models.rope import LongRopeSwitch
from kit import build_checkpoint, hf_greedy

ORIG = 16
NUM_NEW = 14
# Head dim 16, partial rotary 0.5 for Phi-3: 4 factors; Llama rotates all 16 dims: 8.
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.5, 4.0],
             "long_factor": [1.0, 3.0, 7.0, 16.0]}
LLAMA_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": ORIG,
              "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [1.0 + 2.0 * i for i in range(8)]}


def _prompts() -> list[list[int]]:
    """Lengths below, at and above ORIG (every one crosses it while generating NUM_NEW tokens), and a
    shared 12-token prefix both in a short and in a long prompt (their KV must not be shared)."""
    shared = [(5 * j) % 400 + 7 for j in range(12)]
    lengths = [3, 10, 15, 16, 17, 24, 40]
    return [[(11 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate(lengths)] + \
        [shared, shared + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10], shared]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("longrope")
    return {
        "phi3": build_checkpoint(str(root / "phi3"), "phi3", max_position_embeddings=64,
                                 original_max_position_embeddings=ORIG, rope_parameters=PHI3_ROPE),
        "llama": build_checkpoint(str(root / "llama"), "llama", max_position_embeddings=64,
                                  rope_parameters=LLAMA_ROPE),
    }


@pytest.mark.parametrize("family, whole_sequence", [("phi3", True), ("llama", False)])
@pytest.mark.parametrize("caching", [True, False])
def test_engine_equals_hf_greedy_across_original_max(family, whole_sequence, caching, checkpoints, monkeypatch):
    path = checkpoints[family]
    prompts = _prompts()
    expected = [tokens for tokens, _ in hf_greedy(path, prompts, NUM_NEW)]
    # An 8-token budget chunks every prompt longer than 8; 30 blocks of 4 preempt some sequences.
    pipe = fastgen.pipeline(path, token_budget=8, max_seqs=4, num_kv_blocks=30, block_size=4,
                            enable_prefix_caching=caching, progress=False)
    with pipe:
        assert pipe.engine.long_rope == LongRopeSwitch(ORIG, whole_sequence)
        scheduler = pipe.engine.scheduler
        calls = {"preempt": 0, "requeue": 0}
        for name in calls:
            method = getattr(scheduler, f"_{name}")

            def counted(*args, _method=method, _name=name):
                calls[_name] += 1
                return _method(*args)

            monkeypatch.setattr(scheduler, f"_{name}", counted)
        got = [r.token_ids for r in pipe(prompts, do_sample=False, max_new_tokens=NUM_NEW, ignore_eos=True)]
        assert pipe.engine.block_manager.num_free_blocks == 30
    assert got == expected
    assert calls["preempt"] > 0, "the workload must preempt"
    # Phi-3: a prompt of at most ORIG tokens is recomputed once, when it outgrows ORIG before its last
    # token (the 3-token prompt reaches ORIG + 1 tokens only with its last one, never computed).
    crossings = calls["requeue"] - calls["preempt"]
    assert crossings == (sum(ORIG + 1 < len(p) + NUM_NEW and len(p) <= ORIG for p in prompts) if whole_sequence else 0)


def test_long_prompt_does_not_reuse_short_prompt_blocks(checkpoints):
    """The same 12 tokens as the start of a short and of a long prompt hold different K: the second
    request must miss the cache, a repeat of the first must hit it."""
    path = checkpoints["phi3"]
    shared = [(5 * j) % 400 + 7 for j in range(12)]
    with fastgen.pipeline(path, block_size=4, progress=False) as pipe:
        short = pipe([shared], max_new_tokens=1, do_sample=False)[0]
        long = pipe([shared + list(range(30, 40))], max_new_tokens=1, do_sample=False)[0]
        again = pipe([shared], max_new_tokens=1, do_sample=False)[0]
    assert (short.num_cached_tokens, long.num_cached_tokens, again.num_cached_tokens) == (0, 0, 8)


def test_switch_rules():
    phi3, generic = LongRopeSwitch(ORIG, True), LongRopeSwitch(ORIG, False)
    assert not phi3.sequence_is_long(10, ORIG) and phi3.sequence_is_long(10, ORIG + 1)
    assert not generic.sequence_is_long(10, 100) and generic.sequence_is_long(ORIG + 1, ORIG + 1)


def test_compiled_padded_steps_equal_hf(checkpoints):
    """The per-token flag through the static buffers (padded with False) and a compiled step."""
    path = checkpoints["phi3"]
    prompts = _prompts()[1:6]
    with fastgen.pipeline(path, compile="default", buckets=(8,), token_budget=8, max_seqs=4, progress=False) as pipe:
        got = [r.token_ids for r in pipe(prompts, do_sample=False, max_new_tokens=NUM_NEW, ignore_eos=True)]
    assert got == [tokens for tokens, _ in hf_greedy(path, prompts, NUM_NEW)]
