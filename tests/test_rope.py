"""Rotary embeddings against Hugging Face's own RoPE (`LlamaRotaryEmbedding`, `Phi3RotaryEmbedding` and
their `apply_rotary_pos_emb`), for every scaling type, partial rotary, and the compiled forward."""

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, Phi3Config  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402

from fastgen.models.rope import (  # noqa: E402
    DEFAULT_MAX_CACHE_POSITIONS,
    SUPPORTED_ROPE_TYPES,
    RotaryEmbedding,
    build_rotary_embedding,
)

HEAD_DIM = 32
MAX_POS = 256
ORIG = 64  # original_max_position_embeddings where a scaling uses one
BASE = 10000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIG}
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": ORIG,
            "short_factor": [1.0 + 0.05 * i for i in range(12)], "long_factor": [1.5 + 0.7 * i for i in range(12)]}

# name -> (HF family, rope_scaling dict as a checkpoint would carry it, partial_rotary_factor)
CASES = {
    "default": ("llama", None, 1.0),
    "linear": ("llama", {"rope_type": "linear", "factor": 2.5}, 1.0),
    "linear_4x_type_key": ("llama", {"type": "linear", "factor": 2.0}, 1.0),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}, 1.0),
    "llama3": ("llama", LLAMA3, 1.0),
    "llama3_equal_factors": ("llama", dict(LLAMA3, high_freq_factor=1.0), 1.0),  # Llama 4 Scout's
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}, 1.0),
    "yarn_mscale": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG,
                              "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2,
                              "truncate": False}, 1.0),
    "yarn_attention_factor": ("llama", {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9}, 1.0),
    "longrope_explicit": ("llama", dict(LONGROPE, factor=4.0, attention_factor=1.1,
                                        short_factor=[1.0] * 16, long_factor=[1.0 + 0.5 * i for i in range(16)]), 1.0),
    "partial_default": ("phi3", None, 0.5),
    "partial_longrope": ("phi3", LONGROPE, 0.75),
    "partial_su": ("phi3", {k: v for k, v in LONGROPE.items() if k != "rope_type"} | {"type": "su"}, 0.75),
}


def _hf_rope(family: str, scaling: dict | None, partial: float):
    """HF's rotary module and apply function for one case (HF mutates the dict, so it gets a copy)."""
    rope_parameters = dict(copy.deepcopy(scaling or {"rope_type": "default"}), rope_theta=BASE)
    if family == "llama":
        config = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=MAX_POS,
                             rope_parameters=rope_parameters)
        return modeling_llama.LlamaRotaryEmbedding(config), modeling_llama.apply_rotary_pos_emb
    config = Phi3Config(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=MAX_POS,
                        original_max_position_embeddings=ORIG, partial_rotary_factor=partial,
                        rope_parameters=rope_parameters)
    return modeling_phi3.Phi3RotaryEmbedding(config), modeling_phi3.apply_rotary_pos_emb


def _ours(scaling: dict | None, partial: float, **kwargs) -> RotaryEmbedding:
    return build_rotary_embedding(head_dim=HEAD_DIM, rotary_dim=int(HEAD_DIM * partial), max_position=MAX_POS,
                                  base=BASE, rope_scaling=copy.deepcopy(scaling), **kwargs)


def _hf_cos_sin(hf_rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = hf_rope(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]


def _check_cache(rope: RotaryEmbedding, positions, cos: torch.Tensor, sin: torch.Tensor, atol: float = 2e-6) -> None:
    half = rope.rotary_dim // 2
    assert cos.shape[-1] == rope.rotary_dim
    rows = rope.cos_sin_cache[positions]
    # HF's NeoX layout repeats the half-width angles; the cache stores each half once.
    for hf, ours in ((cos, rows[:, :half]), (sin, rows[:, half:])):
        torch.testing.assert_close(ours, hf[:, :half], rtol=0, atol=atol)
        torch.testing.assert_close(ours, hf[:, half:], rtol=0, atol=atol)


def _check_rotation(rope, hf_apply, positions, cos, sin, long_rope=None) -> None:
    """fp32 q/k rotated by ours and by HF's apply function (bf16: `test_bf16_inputs_rotate_exactly_as_hf_does_in_bf16`)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 4, HEAD_DIM, generator=gen)
    k = torch.randn(len(positions), 2, HEAD_DIM, generator=gen)
    q_ours, k_ours = rope(positions, q, k, long_rope)
    # HF wants [batch, heads, tokens, head_dim].
    q_hf, k_hf = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    for ours, hf in ((q_ours, q_hf), (k_ours, k_hf)):
        assert ours.dtype == torch.float32 and ours.shape == (len(positions), hf.shape[1], HEAD_DIM)
        torch.testing.assert_close(ours, hf[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CASES)
def test_matches_hf_within_original_context(name: str) -> None:
    family, scaling, partial = CASES[name]
    hf_rope, hf_apply = _hf_rope(family, scaling, partial)
    rope = _ours(scaling, partial)
    positions = torch.tensor([0, 1, 2, 7, 31, 40, ORIG - 1], dtype=torch.int64)
    cos, sin = _hf_cos_sin(hf_rope, positions)
    if name not in ("default", "partial_default", "dynamic"):  # dynamic scales only beyond max_position
        # The case must exercise its scaling: HF's cos differs from the unscaled one.
        assert not torch.allclose(cos, _hf_cos_sin(_hf_rope(family, None, partial)[0], positions)[0])
    _check_cache(rope, positions, cos, sin)
    _check_rotation(rope, hf_apply, positions, cos, sin)


@pytest.mark.parametrize("name", ["default", "linear", "llama3", "yarn_mscale", "partial_default"])
def test_position_independent_types_match_hf_over_whole_cache(name: str) -> None:
    family, scaling, partial = CASES[name]
    hf_rope, hf_apply = _hf_rope(family, scaling, partial)
    rope = _ours(scaling, partial)
    positions = torch.tensor([ORIG, 100, MAX_POS - 1, rope.max_positions - 1], dtype=torch.int64)
    cos, sin = _hf_cos_sin(hf_rope, positions)
    _check_cache(rope, positions, cos, sin)
    _check_rotation(rope, hf_apply, positions, cos, sin)


def test_dynamic_matches_hf_decode_step_beyond_max_position() -> None:
    family, scaling, partial = CASES["dynamic"]
    rope = _ours(scaling, partial)
    assert rope.max_positions == 2 * MAX_POS
    for position in (MAX_POS - 1, MAX_POS, 300, 2 * MAX_POS - 1):
        # A fresh HF module per step: HF keeps the longest sequence's frequencies until it resets.
        hf_rope, hf_apply = _hf_rope(family, scaling, partial)
        positions = torch.tensor([position], dtype=torch.int64)
        cos, sin = _hf_cos_sin(hf_rope, positions)
        # Beyond max_position HF derives the base on a 0-d tensor, whose pow takes another kernel path than
        # our per-row table: inv_freq differs in the last ulp, angles near 500 rad by a few 1e-6.
        _check_cache(rope, positions, cos, sin, atol=1e-5)
        _check_rotation(rope, hf_apply, positions, cos, sin)


@pytest.mark.parametrize("name", ["partial_longrope", "longrope_explicit"])
def test_longrope_uses_long_factors_from_original_max(name: str) -> None:
    family, scaling, partial = CASES[name]
    hf_rope, hf_apply = _hf_rope(family, scaling, partial)
    rope = _ours(scaling, partial)
    # HF switches a whole sequence longer than ORIG to long factors; by position, ours do from ORIG on
    # (the step's long_rope flag covers the positions below it).
    cos, sin = _hf_cos_sin(hf_rope, torch.arange(MAX_POS, dtype=torch.int64))
    positions = torch.tensor([ORIG, ORIG + 1, 150, MAX_POS - 1], dtype=torch.int64)
    _check_cache(rope, positions, cos[positions], sin[positions])
    _check_rotation(rope, hf_apply, positions, cos[positions], sin[positions])
    short_cos, _ = _hf_cos_sin(_hf_rope(family, scaling, partial)[0], torch.arange(ORIG, dtype=torch.int64))
    assert not torch.allclose(short_cos[1:], cos[1:ORIG])


@pytest.mark.parametrize("name", ["partial_longrope", "longrope_explicit"])
def test_long_rope_flag_gives_positions_below_original_max_the_long_factors(name: str) -> None:
    family, scaling, partial = CASES[name]
    hf_rope, hf_apply = _hf_rope(family, scaling, partial)
    rope = _ours(scaling, partial)
    positions = torch.tensor([0, 5, ORIG - 1, ORIG, 100, 3], dtype=torch.int64)
    # HF over a sequence longer than ORIG: long factors at every position.
    long_cos, long_sin = _hf_cos_sin(hf_rope, torch.arange(MAX_POS, dtype=torch.int64))
    flags = torch.tensor([True, True, True, False, False, True])  # positions >= ORIG are long whatever the flag
    _check_rotation(rope, hf_apply, positions, long_cos[positions], long_sin[positions], long_rope=flags)
    # A sequence within ORIG: short factors (HF recomputes them for a short sequence).
    short = positions[[0, 1, 2, 5]]
    short_cos, short_sin = _hf_cos_sin(_hf_rope(family, scaling, partial)[0], short)
    _check_rotation(rope, hf_apply, short, short_cos, short_sin, long_rope=torch.zeros(4, dtype=torch.bool))
    assert rope.original_max == ORIG and rope.max_positions == rope.cos_sin_cache.shape[0] - ORIG
    assert _ours(CASES["yarn"][1], 1.0).original_max is None


@pytest.mark.parametrize("name", ["default", "llama3", "partial_longrope"])
def test_bf16_inputs_rotate_exactly_as_hf_does_in_bf16(name: str) -> None:
    # HF casts cos/sin to the activations' dtype and rounds each product and the sum to it.
    family, scaling, partial = CASES[name]
    hf_rope, hf_apply = _hf_rope(family, scaling, partial)
    rope = _ours(scaling, partial)
    positions = torch.tensor([3, 0, 17, 63], dtype=torch.int64)
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(len(positions), 4, HEAD_DIM, generator=gen) * 3).bfloat16()
    k = (torch.randn(len(positions), 2, HEAD_DIM, generator=gen) * 3).bfloat16()
    cos, sin = hf_rope(q, positions[None])
    assert cos.dtype == torch.bfloat16
    q_hf, k_hf = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    step_cache: dict = {}
    for _ in range(2):  # the second call takes the step's cached cos/sin rows
        q_ours, k_ours = rope(positions, q, k, None, step_cache)
        assert q_ours.dtype == k_ours.dtype == torch.bfloat16
        assert torch.equal(q_ours, q_hf[0].transpose(0, 1)) and torch.equal(k_ours, k_hf[0].transpose(0, 1))
    # Not the fp32 rotation rounded once: the test tells the two apart.
    q_fp32, _ = rope(positions, q.float(), k.float())
    assert not torch.equal(q_fp32.bfloat16(), q_ours)


def test_cache_length_and_dtype() -> None:
    assert _ours(None, 1.0).max_positions == MAX_POS
    assert _ours({"rope_type": "linear", "factor": 2.0}, 1.0).max_positions == 2 * MAX_POS
    assert _ours(LLAMA3, 1.0).max_positions == ORIG * 8
    assert _ours(None, 1.0, max_cache_len=40).max_positions == 40
    capped = build_rotary_embedding(8, 8, DEFAULT_MAX_CACHE_POSITIONS, BASE, {"rope_type": "linear", "factor": 4.0})
    assert capped.max_positions == DEFAULT_MAX_CACHE_POSITIONS
    rope = _ours(CASES["yarn"][1], 1.0)
    assert rope.cos_sin_cache.dtype == torch.float32 and "cos_sin_cache" not in rope.state_dict()
    assert rope.to(torch.bfloat16).cos_sin_cache.dtype == torch.float32
    assert _ours(None, 1.0, dtype=torch.bfloat16).cos_sin_cache.dtype == torch.bfloat16


def test_unsupported_rope_type_names_it_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="'mrope'.*default, linear, dynamic, llama3, yarn, longrope"):
        _ours({"rope_type": "mrope", "factor": 2.0}, 1.0)
    assert set(SUPPORTED_ROPE_TYPES) == {"default", "linear", "dynamic", "llama3", "yarn", "longrope"}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rotary_dim": 7}, ValueError, "rotary_dim"),
        ({"rotary_dim": 64}, ValueError, "rotary_dim"),
        ({"base": 0.5}, ValueError, "base"),
        ({"max_position": 0}, ValueError, "max_position"),
        ({"rope_scaling": {"rope_type": "linear"}}, ValueError, "'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": -1}}, ValueError, "factor"),
        ({"rope_scaling": dict(LLAMA3, high_freq_factor=None)}, ValueError, "high_freq_factor"),
        ({"rope_scaling": dict(LONGROPE, short_factor=[1.0] * 3)}, ValueError, "short_factor"),
        ({"rope_scaling": [("rope_type", "linear")]}, TypeError, "rope_scaling"),
        ({"dtype": torch.int32}, TypeError, "dtype"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, error: type, match: str) -> None:
    args = {"head_dim": HEAD_DIM, "rotary_dim": HEAD_DIM, "max_position": MAX_POS, "base": BASE} | kwargs
    if "short_factor" in match:
        args["rotary_dim"] = 24
    with pytest.raises(error, match=match):
        build_rotary_embedding(**args)


def test_forward_rejects_bad_shapes() -> None:
    rope = _ours(None, 1.0)
    q = torch.zeros(3, 4, HEAD_DIM)
    with pytest.raises(ValueError, match="key"):
        rope(torch.arange(3), q, torch.zeros(3, 2, HEAD_DIM + 2))
    with pytest.raises(ValueError, match="positions"):
        rope(torch.arange(3).float(), q, q)


def test_compiles_fullgraph_and_matches_hf() -> None:
    family, scaling, partial = CASES["partial_longrope"]
    hf_rope, hf_apply = _hf_rope(family, scaling, partial)
    rope = _ours(scaling, partial)
    compiled = torch.compile(rope, fullgraph=True, dynamic=False)
    positions = torch.tensor([5, 0, 63, 9], dtype=torch.int64)
    cos, sin = _hf_cos_sin(hf_rope, positions)
    _check_rotation(compiled, hf_apply, positions, cos, sin)


def test_step_cache_gathers_cos_sin_once_per_rotary() -> None:
    """With a step's cache dict the first call of each rotary gathers its cos/sin rows and later calls
    (the other layers) reuse them, with the same results as without; two rotaries sharing the dict
    (a model's local and global bases) keep their own rows."""
    local, glob = (build_rotary_embedding(head_dim=16, rotary_dim=16, max_position=64, base=b) for b in (10.0, 1e4))
    gathers = []
    for rope in (local, glob):
        original = rope._cos_sin
        rope._cos_sin = lambda *a, _original=original, _rope=rope: gathers.append(_rope) or _original(*a)
    positions = torch.tensor([3, 0, 41])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    step_cache: dict = {}
    for _ in range(3):
        for rope in (local, glob):
            got = rope(positions, q, k, None, step_cache)
            plain = rope(positions, q, k)
            assert all(torch.equal(a, b) for a, b in zip(got, plain))
    assert gathers.count(local) == 1 + 3 and gathers.count(glob) == 1 + 3  # once cached, thrice plain
    assert not torch.equal(local(positions, q, k)[0], glob(positions, q, k)[0])
