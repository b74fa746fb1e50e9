"""The safetensors loader: checkpoint layouts (single file, sharded, tied embeddings, HF cache),
both config formats, dtype and meta-device construction, and a clear error for every broken input."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import huggingface_hub.constants
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from fastgen.models.config import ModelConfig
from fastgen.models.loader import load_model, resolve_model_dir
from kit import PagedRunner, rewrite_config

PROMPT = [5, 17, 300, 42, 99, 7, 256, 3, 11, 480, 64, 23, 150, 8, 77, 401, 12, 9, 333, 2, 45, 61, 19, 87,
          250, 14, 6, 499, 71, 30]
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
K_PROJ = "model.layers.0.self_attn.k_proj.weight"


def _logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of PROMPT run as a prefill chunk then two decode steps (blocks of 4, so it crosses blocks)."""
    runner = PagedRunner(model, num_blocks=32, block_size=4)
    seq = runner.add(PROMPT)
    parts = [runner.step([(seq, len(PROMPT) - 2)]), runner.step([(seq, 1)]), runner.step([(seq, 1)])]
    return torch.cat(parts)


def _copy_checkpoint(src: str, dst: str, tensors: dict[str, torch.Tensor] | None = None) -> str:
    """`src`'s config files in `dst` with `tensors` (default: src's own) saved as model.safetensors."""
    os.makedirs(dst)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(src, name), dst)
    if tensors is None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def _read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


# --- checkpoint layouts ------------------------------------------------------------------------


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoints, tmp_path):
    single = tiny_checkpoints["llama"]
    sharded = str(tmp_path / "sharded")
    hf = transformers.AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    hf.save_pretrained(sharded, max_shard_size="20KB")
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert not os.path.isfile(os.path.join(sharded, "model.safetensors"))
    assert len(shards) >= 3, shards

    expected = _logits(load_model(single, progress=False).model)
    got = _logits(load_model(sharded, progress=False).model)
    assert expected.std() > 1.0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_tied_embeddings_share_one_parameter(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    tensors = _tensors(path)
    assert "lm_head.weight" not in tensors, "the qwen2 tiny checkpoint should omit the tied head"
    loaded = load_model(path, progress=False)
    model = loaded.model
    assert loaded.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta
    torch.testing.assert_close(model.lm_head.weight, tensors["model.embed_tokens.weight"], rtol=0, atol=0)
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in tensors.values())


def test_tied_checkpoint_that_also_stores_lm_head_loads(tiny_checkpoints, tmp_path):
    """Some tied checkpoints save `lm_head.weight` anyway; the shared weight still comes from the embedding."""
    src = tiny_checkpoints["qwen2"]
    tensors = _tensors(src)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    model = load_model(_copy_checkpoint(src, str(tmp_path / "ckpt"), tensors), progress=False).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


# --- config formats ----------------------------------------------------------------------------


def _as_4x(path: str, rope_scaling: dict | None) -> None:
    """Rewrite the 5.x config at `path` with 4.x key names."""
    cfg = _read_config(path)
    params = cfg["rope_parameters"]
    rewrite_config(path, dtype=None, rope_parameters=None, torch_dtype=cfg["dtype"],
                   rope_theta=params["rope_theta"], rope_scaling=rope_scaling)


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_4x_and_5x_configs_give_same_rope_and_logits(tiny_checkpoints, tmp_path, type_key):
    v5 = tiny_checkpoints["llama"]
    assert "rope_parameters" in _read_config(v5) and "dtype" in _read_config(v5)
    v4 = _copy_checkpoint(v5, str(tmp_path / "v4"))
    _as_4x(v4, {type_key: "llama3", **LLAMA3})
    raw4 = _read_config(v4)
    assert "rope_parameters" not in raw4 and "dtype" not in raw4 and raw4["torch_dtype"] == "float32"

    new, old = load_model(v5, progress=False), load_model(v4, progress=False)
    for cfg in (new.config, old.config):
        assert cfg.rope_theta == 500000.0
        assert cfg.rope_scaling == {"rope_type": "llama3", **LLAMA3}
        assert cfg.partial_rotary_factor == 1.0
        assert cfg.dtype == torch.float32
    expected = _logits(new.model)
    torch.testing.assert_close(_logits(old.model), expected, rtol=0, atol=0)

    # Control: the scaling must matter for this prompt, or the comparison above would prove nothing.
    unscaled = _copy_checkpoint(v5, str(tmp_path / "unscaled"))
    _as_4x(unscaled, None)
    assert not torch.allclose(_logits(load_model(unscaled, progress=False).model), expected, atol=1e-3)


BASE_RAW = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072)

# name -> (4.x fields, 5.x fields, expected rope_theta, expected rope_scaling, expected partial_rotary_factor)
FORMAT_CASES = {
    "default": ({"rope_theta": 1e6, "rope_scaling": None},
                {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, 1e6, None, 1.0),
    "default_implicit_theta": ({}, {"rope_parameters": {"rope_type": "default"}}, 10000.0, None, 1.0),
    "llama3_type": ({"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}},
                    {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}},
                    5e5, {"rope_type": "llama3", **LLAMA3}, 1.0),
    "llama3_rope_type": ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},
                         {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}},
                         5e5, {"rope_type": "llama3", **LLAMA3}, 1.0),
    "linear": ({"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
               {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
               10000.0, {"rope_type": "linear", "factor": 2.0}, 1.0),
    "yarn": ({"rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 32768}},
             {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                  "rope_theta": 1e6}},
             1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1.0),
    "partial_rotary": ({"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                       {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5}}, 10000.0, None, 0.5),
}


@pytest.mark.parametrize("case", sorted(FORMAT_CASES))
def test_from_dict_normalises_both_formats_equally(case):
    fields4, fields5, theta, scaling, partial = FORMAT_CASES[case]
    old = ModelConfig.from_dict({**BASE_RAW, "torch_dtype": "bfloat16", **fields4})
    new = ModelConfig.from_dict({**BASE_RAW, "dtype": "bfloat16", **fields5})
    for cfg in (old, new):
        assert cfg.rope_theta == theta and isinstance(cfg.rope_theta, float)
        assert cfg.rope_scaling == scaling
        assert cfg.partial_rotary_factor == partial
        assert cfg.dtype == torch.bfloat16
        assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 16, 4)


def test_from_dict_does_not_modify_the_raw_dict():
    raw = {**BASE_RAW, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3}}
    snapshot = json.dumps(raw, sort_keys=True)
    ModelConfig.from_dict(raw)
    assert json.dumps(raw, sort_keys=True) == snapshot


QWEN2_RAW = {**BASE_RAW, "model_type": "qwen2"}


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2}, [0, 0, 0, 0]),
        ({"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}, [0, 0, 4096, 4096]),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, [64] * 4),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 28}, [0] * 4),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 28,
          "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]},
         [0, 64, 0, 64]),
        ({"use_sliding_window": False, "sliding_window": None, "layer_types": ["full_attention"] * 4}, [0] * 4),
    ],
    ids=["disabled", "after_max_window_layers", "all_sliding", "none_below_max", "layer_types", "5x_disabled"],
)
def test_qwen2_layer_windows(fields, expected):
    assert ModelConfig.from_dict({**QWEN2_RAW, **fields}).layer_sliding_windows == expected


@pytest.mark.parametrize("use_sliding_window, max_window_layers", [(True, 1), (True, 3), (False, 1)])
def test_qwen2_layer_windows_agree_with_transformers(use_sliding_window, max_window_layers):
    hf = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=use_sliding_window, sliding_window=32,
                                  max_window_layers=max_window_layers)
    expected = [32 if t == "sliding_attention" else 0 for t in hf.layer_types]
    assert ModelConfig.from_dict(hf.to_dict()).layer_sliding_windows == expected
    legacy = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
    legacy["sliding_window"] = 32
    assert ModelConfig.from_dict(legacy).layer_sliding_windows == expected


def test_loaded_layers_carry_their_window(tiny_checkpoints, tmp_path):
    mistral = load_model(tiny_checkpoints["mistral"], progress=False).model
    assert [layer.self_attn.sliding_window for layer in mistral.model.layers] == [12, 12]
    path = _copy_checkpoint(tiny_checkpoints["qwen2"], str(tmp_path / "qwen2"))
    rewrite_config(path, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                   layer_types=["full_attention", "sliding_attention"])
    qwen2 = load_model(path, progress=False).model
    assert [layer.self_attn.sliding_window for layer in qwen2.model.layers] == [0, 6]


# --- dtype and meta construction ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "torch.bfloat16"])
def test_dtype_argument_casts_every_parameter(tiny_checkpoints, dtype):
    path = tiny_checkpoints["llama"]
    model = load_model(path, dtype=dtype, progress=False).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    tensors = _tensors(path)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    expected = torch.cat([tensors[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv"]).bfloat16()
    torch.testing.assert_close(qkv, expected, rtol=0, atol=0)
    logits = _logits(model)
    reference = _logits(load_model(path, progress=False).model)
    assert torch.isfinite(logits).all()
    assert torch.corrcoef(torch.stack([logits.flatten(), reference.flatten()]))[0, 1] > 0.99


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_checkpoint_dtype_is_kept_by_default(tiny_checkpoints, tmp_path, key):
    path = _copy_checkpoint(tiny_checkpoints["llama"], str(tmp_path / "ckpt"))
    rewrite_config(path, **{"dtype": None, key: "bfloat16"})
    loaded = load_model(path, progress=False)
    assert loaded.config.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    fp32 = load_model(path, dtype=torch.float32, progress=False).model
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


def test_model_is_built_on_meta_without_random_init(tiny_checkpoints, monkeypatch):
    """Random init on real memory would advance the CPU generator or call `torch.nn.init` on a real tensor."""
    real_inits = []
    for name in ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                 "xavier_normal_", "trunc_normal_", "orthogonal_"):
        original = getattr(torch.nn.init, name)

        def spy(tensor, *args, _original=original, _name=name, **kwargs):
            if not tensor.is_meta:
                real_inits.append((_name, tuple(tensor.shape)))
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, name, spy)

    # The spies and the generator check both see an ordinary, non-meta construction.
    state = torch.random.get_rng_state()
    torch.nn.Linear(4, 4)
    assert real_inits and not torch.equal(state, torch.random.get_rng_state())
    real_inits.clear()

    state = torch.random.get_rng_state()
    model = load_model(tiny_checkpoints["llama"], progress=False).model
    assert torch.equal(state, torch.random.get_rng_state()), "building the model consumed random numbers"
    assert real_inits == []
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert all(not p.requires_grad for p in model.parameters()) and not model.training


# --- errors ------------------------------------------------------------------------------------


def test_missing_directory(tmp_path):
    path = str(tmp_path / "no_such_model")
    with pytest.raises(FileNotFoundError, match="no_such_model.*does not exist"):
        load_model(path, progress=False)


def test_unknown_hub_id_not_in_cache(tmp_path, monkeypatch):
    cache = tmp_path / "empty_cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(FileNotFoundError) as info:
        load_model("some-org/not-a-cached-model", progress=False)
    message = str(info.value)
    assert "'some-org/not-a-cached-model'" in message
    assert "Hugging Face cache" in message and "download" in message


def test_missing_config_json(tiny_checkpoints, tmp_path):
    path = _copy_checkpoint(tiny_checkpoints["llama"], str(tmp_path / "ckpt"))
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(path, progress=False)


def test_unsupported_model_type(tiny_checkpoints, tmp_path):
    path = _copy_checkpoint(tiny_checkpoints["llama"], str(tmp_path / "ckpt"))
    rewrite_config(path, model_type="bloom")
    with pytest.raises(ValueError) as info:
        load_model(path, progress=False)
    message = str(info.value)
    assert "'bloom'" in message
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in message


def _drop(name: str):
    return lambda tensors: tensors.pop(name)


def _reshape(name: str, shape: tuple[int, ...]):
    return lambda tensors: tensors.update({name: torch.zeros(shape)})


# case -> (tiny family, edit of the tensor dict, fragments the error message must hold)
TENSOR_ERRORS = {
    "missing_k_proj": ("llama", _drop(K_PROJ), [f"lacks tensor(s): {K_PROJ}"]),
    "missing_up_proj": ("llama", _drop("model.layers.1.mlp.up_proj.weight"),
                        ["lacks tensor(s): model.layers.1.mlp.up_proj.weight"]),
    "missing_norm": ("llama", _drop("model.norm.weight"), ["lacks tensor(s): model.norm.weight"]),
    "missing_lm_head_untied": ("llama", _drop("lm_head.weight"), ["lacks tensor(s): lm_head.weight"]),
    "missing_qwen2_v_bias": ("qwen2", _drop("model.layers.1.self_attn.v_proj.bias"),
                             ["model.layers.1.self_attn.v_proj.bias"]),
    "misshaped_k_proj": ("llama", _reshape(K_PROJ, (32, 63)), [K_PROJ, "(32, 63)", "(32, 64)"]),
    "misshaped_gate_proj": ("llama", _reshape("model.layers.0.mlp.gate_proj.weight", (129, 64)),
                            ["model.layers.0.mlp.gate_proj.weight", "(129, 64)", "(128, 64)"]),
    "misshaped_norm": ("llama", _reshape("model.norm.weight", (65,)), ["model.norm.weight", "(65,)", "(64,)"]),
    "unexpected": ("llama", _reshape("model.layers.0.self_attn.mystery.weight", (3,)),
                   ["model.layers.0.self_attn.mystery.weight", "has no place"]),
}


@pytest.mark.parametrize("case", sorted(TENSOR_ERRORS))
def test_bad_tensor_is_named(tiny_checkpoints, tmp_path, case):
    model_type, edit, fragments = TENSOR_ERRORS[case]
    src = tiny_checkpoints[model_type]
    tensors = _tensors(src)
    edit(tensors)
    path = _copy_checkpoint(src, str(tmp_path / "ckpt"), tensors)
    with pytest.raises(ValueError) as info:
        load_model(path, progress=False)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_legacy_rotary_inv_freq_is_ignored(tiny_checkpoints, tmp_path):
    src = tiny_checkpoints["llama"]
    tensors = _tensors(src)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    path = _copy_checkpoint(src, str(tmp_path / "ckpt"), tensors)
    assert load_model(path, progress=False).model is not None


def test_no_weights_file(tiny_checkpoints, tmp_path):
    path = _copy_checkpoint(tiny_checkpoints["llama"], str(tmp_path / "ckpt"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path, progress=False)


def test_only_bin_weights(tiny_checkpoints, tmp_path):
    path = _copy_checkpoint(tiny_checkpoints["llama"], str(tmp_path / "ckpt"))
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save({"model.norm.weight": torch.ones(64)}, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"\.bin.*safetensors"):
        load_model(path, progress=False)


def test_shard_missing_from_index(tiny_checkpoints, tmp_path):
    path = str(tmp_path / "sharded")
    transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], dtype=torch.float32).save_pretrained(
        path, max_shard_size="20KB")
    with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    victim = weight_map[K_PROJ]
    os.remove(os.path.join(path, victim))
    with pytest.raises(FileNotFoundError, match=victim.replace(".", r"\.")):
        load_model(path, progress=False)


# --- Hugging Face cache ------------------------------------------------------------------------


def _fake_hub_cache(root, repo_id: str, src: str) -> str:
    """Lay `src` out as huggingface_hub caches a download: blobs, a snapshot of symlinks, refs/main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in os.listdir(src):
        data = open(os.path.join(src, name), "rb").read()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return str(snapshot)


def test_hub_id_resolves_from_local_cache(tiny_checkpoints, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = _fake_hub_cache(cache, "tiny-org/tiny-llama", tiny_checkpoints["llama"])
    # huggingface_hub reads HF_HUB_CACHE once, at import: set the env var and the constant it became.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))

    assert os.path.realpath(resolve_model_dir("tiny-org/tiny-llama")) == os.path.realpath(snapshot)
    loaded = load_model("tiny-org/tiny-llama", progress=False)
    assert os.path.realpath(loaded.model_dir) == os.path.realpath(snapshot)
    assert loaded.eos_token_ids == [2]
    expected = _logits(load_model(tiny_checkpoints["llama"], progress=False).model)
    torch.testing.assert_close(_logits(loaded.model), expected, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="tiny-org/other"):
        resolve_model_dir("tiny-org/other")


def test_hf_hub_cache_env_var_set_at_start_is_honoured(tiny_checkpoints, tmp_path):
    """The user's path: HF_HUB_CACHE in the environment before Python starts, nothing patched."""
    cache = tmp_path / "hub"
    snapshot = _fake_hub_cache(cache, "tiny-org/tiny-qwen2", tiny_checkpoints["qwen2"])
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    code = ("from fastgen.models.loader import load_model\n"
            "loaded = load_model('tiny-org/tiny-qwen2', progress=False)\n"
            "print(loaded.model_dir, loaded.config.model_type)")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    model_dir, model_type = result.stdout.split()
    assert os.path.realpath(model_dir) == os.path.realpath(snapshot) and model_type == "qwen2"


def test_home_relative_path(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    _copy_checkpoint(tiny_checkpoints["llama"], str(tmp_path / "models" / "tiny"))
    loaded = load_model("~/models/tiny", progress=False)
    assert loaded.model_dir == str(tmp_path / "models" / "tiny")
    with pytest.raises(FileNotFoundError, match="~/models/absent"):
        load_model("~/models/absent", progress=False)


def test_local_directory_wins_over_hub_lookup(tiny_checkpoints, monkeypatch):
    path = tiny_checkpoints["qwen3"]
    monkeypatch.chdir(os.path.dirname(path))
    assert resolve_model_dir(os.path.basename(path)) == os.path.basename(path)
    assert load_model(os.path.basename(path), progress=False).config.model_type == "qwen3"


def test_compile_off_pipeline_never_imports_dynamo(tiny_checkpoints):
    """Building on meta must not run random fills (a meta `normal_` imports torch._dynamo, ~1.3 s of a
    compile-off start-up), and an eager step must not need Dynamo either."""
    code = ("import sys, fastgen\n"
            f"pipe = fastgen.pipeline({tiny_checkpoints['llama']!r}, compile='off', progress=False)\n"
            "out = pipe(['hello world'], max_new_tokens=3, do_sample=False)\n"
            "print(out[0].generated_length, 'torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["3", "False"], result.stdout
