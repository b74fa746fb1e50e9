"""Load a Hugging Face checkpoint directory into one of our model classes.

The module tree is built with its parameters on the meta device (no memory or time spent on
random initialisation); each safetensors tensor is then read from the memory-mapped file, cast
to the target dtype and moved to the target device one at a time, so the model never exists as
a full fp32 copy in RAM.

A GGUF file (or a directory holding one) resolves to a prepared directory with its config and
tokenizer (`fastgen.models.gguf`); its weights are dequantized and placed the same way, one tensor
at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from fastgen.models import gguf as gguf_format
from fastgen.models.config import ModelConfig, load_generation_eos, parse_dtype
from fastgen.models.layers import decoder_layers
from fastgen.models.parallel import SINGLE, TensorParallel, read_whole
from fastgen.models.quant import DEFAULT_GROUP_SIZE, QuantizedLinear, quantize_decoder_linears
from fastgen.models.registry import get_model_class


class _SkipRandomInit(TorchFunctionMode):
    """Turns the random fills of `reset_parameters` into no-ops while the model is built on meta, and
    creates the parameters' `torch.empty` storage there directly.

    The values would be discarded anyway, and a meta `normal_` goes through `torch._refs`, whose
    first call imports `torch._dynamo` (~1.3 s that a compile-off start-up otherwise never pays).
    `init_empty_weights` moves each parameter to meta only after its module allocated it: a stacked
    expert tensor of a large MoE (DeepSeek-V3's 256 experts' gate/up: 30 GB in fp32) would need that
    memory first. Buffers are never created with a bare `torch.empty`, so they stay real.
    """

    _RANDOM_FILLS = frozenset((torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_,
                               nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
                               nn.init.xavier_uniform_, nn.init.xavier_normal_))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._RANDOM_FILLS:
            return args[0] if args else kwargs["tensor"]
        if func is torch.empty and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


# Checkpoint tensors that hold no weights we use (old Llama checkpoints saved rotary tables).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(slots=True)
class LoadedModel:
    """A model ready to run, with what the engine needs to know about its checkpoint."""

    model: nn.Module
    """The model, in eval mode, on the target device and dtype."""
    config: ModelConfig
    """The normalised config."""
    model_dir: str
    """The local checkpoint directory (tokenizer files live here too)."""
    eos_token_ids: list[int]
    """EOS ids from generation_config.json, else from config.json."""


def resolve_model_dir(model_name_or_path: str) -> str:
    """A local directory for `model_name_or_path`: the path itself, or the HF cache's snapshot.

    A hub id is only looked up in the local Hugging Face cache, so an offline machine with the
    model cached works; nothing is downloaded. A .gguf file, or a directory (or snapshot) whose only
    weights are one .gguf file, resolves to its prepared directory (`gguf.prepare_gguf_dir`).
    """
    local = os.path.expanduser(model_name_or_path)
    if os.path.exists(local):
        gguf_file = gguf_format.find_gguf_file(local)
        if gguf_file is not None:
            return gguf_format.prepare_gguf_dir(gguf_file)
        if os.path.isdir(local):
            return local
        raise ValueError(f"{model_name_or_path!r} is a file; fastgen loads a checkpoint directory or a .gguf file")
    looks_like_path = (model_name_or_path.startswith((".", "/", "~")) or model_name_or_path.count("/") > 1
                       or model_name_or_path.endswith(gguf_format.GGUF_SUFFIX))
    if not looks_like_path:
        from huggingface_hub import snapshot_download

        try:
            snapshot = snapshot_download(model_name_or_path, local_files_only=True)
        except Exception as exc:  # the hub raises several error types for "not cached"
            raise FileNotFoundError(
                f"model {model_name_or_path!r} is neither a local directory nor in the Hugging Face cache "
                f"({type(exc).__name__}); download it first, e.g. `huggingface-cli download {model_name_or_path}`"
            ) from exc
        gguf_file = gguf_format.find_gguf_file(snapshot)
        return gguf_format.prepare_gguf_dir(gguf_file) if gguf_file is not None else snapshot
    raise FileNotFoundError(f"model path {model_name_or_path!r} does not exist")


def _safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: from the shard index if there is one."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shard(s) named in the index are missing: {', '.join(missing)}")
        return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    if any(f.endswith(".bin") for f in os.listdir(model_dir)):
        raise ValueError(f"{model_dir} holds only PyTorch .bin weights; fastgen loads safetensors (convert with save_pretrained(safe_serialization=True))")
    raise FileNotFoundError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


class _WeightSink:
    """Places checkpoint tensors into a meta-initialised model, tracking what arrived."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device,
                 on_layer_loaded: Callable[[int, nn.Module], None] | None = None) -> None:
        self.model = model
        self.dtype = dtype
        self.device = device
        self.params = dict(model.named_parameters())
        # Persistent buffers are checkpoint tensors too, loaded in their own dtype (the fp32 router
        # score-correction bias of GLM-4.5 and DeepSeek-V3).
        self.params.update(_persistent_buffers(model))
        self.packed = getattr(model, "packed_modules_mapping", {})
        # MoE models stack per-expert checkpoint weights into one parameter (see _target).
        self.experts = getattr(model, "stacked_experts_mapping", {})
        self.stacked = {target for target, _ in self.experts.values()}
        # Per parameter: shard indices (-1 = whole) or, for stacked experts, (expert, shard) pairs.
        self.loaded: dict[str, set[int | tuple[int, int]]] = {}
        # Decoder layers still waiting for tensors (index -> parameter names), watched only when
        # `on_layer_loaded` wants each layer as soon as it is complete (weight offload moves it out
        # then, so the whole model never sits in memory at once).
        self.on_layer_loaded = on_layer_loaded
        self.layer_of: dict[str, int] = {}
        self.pending: dict[int, set[str]] = {}
        self.settled: set[str] = set()
        if on_layer_loaded is not None:
            layers = decoder_layers(model)
            prefix = next(name for name, module in model.named_modules() if module is layers) + "."
            for param_name in self.params:
                if param_name.startswith(prefix):
                    index = int(param_name[len(prefix):].partition(".")[0])
                    self.layer_of[param_name] = index
                    self.pending.setdefault(index, set()).add(param_name)

    def _target(self, name: str) -> tuple[str, int | None, int | None]:
        """Our parameter name, shard index and expert index for a checkpoint tensor name.

        `<prefix>.<i>.<module>.weight` with `<module>` in the model's `stacked_experts_mapping`
        (`{module: (parameter, shard)}`) goes to expert `i` of our `<prefix>.<parameter>`. Plain
        renames (shard None) apply to every component they name (`shared_experts.gate_proj` is
        renamed, then packed).
        """
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.experts and i > 0 and parts[i - 1].isdigit() and parts[i + 1 :] == ["weight"]:
                stacked, shard = self.experts[part]
                return ".".join(parts[: i - 1] + [stacked]), shard, int(parts[i - 1])
            if part in self.packed:
                merged, shard = self.packed[part]
                parts[i] = merged
                if shard is not None:
                    return ".".join(parts), shard, None
        return ".".join(parts), None, None

    def _shard_sizes(self, param_name: str) -> list[int] | None:
        """Rows of each shard packed into `param_name` (per expert if stacked), None if not packed.

        A module's `output_sizes` is a list for all its parameters (MergedLinear) or a dict keyed by
        parameter name (stacked experts, where only `gate_up_proj` is packed).
        """
        module_name, _, attr = param_name.rpartition(".")
        sizes = getattr(self.model.get_submodule(module_name), "output_sizes", None)
        return sizes.get(attr) if isinstance(sizes, dict) else sizes

    def _shard_rows(self, param_name: str, shard: int) -> tuple[int, int]:
        """(first row, rows) that checkpoint shard `shard` fills in `param_name` (per expert if stacked)."""
        sizes = self._shard_sizes(param_name)
        return sum(sizes[:shard]), sizes[shard]

    def _materialise(self, param_name: str) -> torch.Tensor:
        """The real tensor behind `param_name`, allocating it the first time."""
        module_name, _, attr = param_name.rpartition(".")
        module = self.model.get_submodule(module_name)
        param = getattr(module, attr)
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=self.dtype, device=self.device), requires_grad=False)
            setattr(module, attr, param)
            self.params[param_name] = param
        return param.data

    def put(self, name: str, tensor) -> None:
        """Copy checkpoint tensor `name` into its place (cast and moved), checking its shape.

        `tensor` is a tensor or a safetensors lazy slice. Under tensor parallelism the module that
        owns the parameter picks this rank's slice (`load_checkpoint_shard`), so only those bytes
        are read from the file.

        A model whose checkpoint does not mirror its module tree (other prefixes, `[in, out]`
        weights, interleaved fused projections, buffers to skip) defines
        `adapt_checkpoint_tensor(name, tensor) -> (name, tensor) | None`: the name and tensor in our
        layout, or None to ignore the tensor.
        """
        source = name  # errors name the tensor as the checkpoint does
        adapt = getattr(self.model, "adapt_checkpoint_tensor", None)
        if adapt is not None:
            adapted = adapt(name, read_whole(tensor))
            if adapted is None:
                return
            name, tensor = adapted
        param_name, shard, expert = self._target(name)
        if param_name not in self.params:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.model.config.tie_word_embeddings):
                return
            raise ValueError(f"checkpoint tensor {source!r} has no place in {type(self.model).__name__}")
        module_name, _, attr = param_name.rpartition(".")
        module = self.model.get_submodule(module_name)
        sharder = getattr(module, "load_checkpoint_shard", None)
        if sharder is not None and self.model.config.parallel.size > 1:
            tensor = sharder(attr, shard, tensor)
        else:
            tensor = read_whole(tensor)
        piece = -1 if shard is None else shard
        if isinstance(module, QuantizedLinear) and attr == "weight":
            # Quantized as it is placed: the full-precision weight never exists beyond this one tensor.
            start, rows = (0, module.out_features) if shard is None else self._shard_rows(param_name, shard)
            if tuple(tensor.shape) != (rows, module.in_features):
                raise ValueError(f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {(rows, module.in_features)}")
            module.load_rows(start, tensor, self.device)
            self.loaded.setdefault(param_name, set()).add(piece)
            self._settle(param_name)
            return
        dest = self._materialise(param_name)
        if expert is not None:
            if expert >= dest.shape[0]:
                raise ValueError(f"checkpoint tensor {source!r} names expert {expert}, but the model has {dest.shape[0]}")
            dest = dest[expert]
        if shard is not None:
            dest = dest.narrow(0, *self._shard_rows(param_name, shard))
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        self.loaded.setdefault(param_name, set()).add(piece if expert is None else (expert, piece))
        self._settle(param_name)

    def _missing(self, param_name: str, param: torch.Tensor) -> list[str]:
        """Checkpoint names of the pieces of `param_name` that have not arrived yet."""
        sizes = self._shard_sizes(param_name)
        loaded = self.loaded.get(param_name, set())
        # A merged parameter may also arrive whole under its own name (Phi-3 stores qkv_proj fused).
        expected = set(range(len(sizes))) if sizes is not None and -1 not in loaded else {-1}
        if param_name.rpartition(".")[2] in self.stacked and -1 not in loaded:
            # Stacked experts arrive whole (transformers 5's fused layout) or expert by expert.
            expected = {(expert, shard) for expert in range(param.shape[0]) for shard in expected}
        return [self._checkpoint_name(param_name, shard) for shard in sorted(expected - loaded)]

    def _settle(self, param_name: str) -> None:
        """Hand a watched decoder layer to `on_layer_loaded` once its last tensor arrived."""
        index = self.layer_of.get(param_name)
        if index is None or self._missing(param_name, self.params[param_name]):
            return
        pending = self.pending[index]
        pending.discard(param_name)
        self.settled.add(param_name)
        if not pending:
            del self.pending[index]
            self.on_layer_loaded(index, decoder_layers(self.model)[index])

    def check_complete(self) -> None:
        """Raise naming every checkpoint tensor that never arrived."""
        missing = []
        for param_name, param in self.params.items():
            if param_name not in self.settled:  # a settled layer's tensors may have moved out since
                missing += self._missing(param_name, param)
        if missing:
            # dict.fromkeys: a merged module without a packed mapping names the same tensor per shard.
            raise ValueError(f"checkpoint lacks tensor(s): {', '.join(dict.fromkeys(missing))}")

    def _checkpoint_name(self, param_name: str, shard: int | tuple[int, int]) -> str:
        """The checkpoint name that would have filled `param_name`'s shard (or (expert, shard))."""
        if isinstance(shard, tuple):
            expert, shard = shard
            prefix, _, stacked = param_name.rpartition(".")
            for ckpt_part, (target, index) in self.experts.items():
                if target == stacked and (-1 if index is None else index) == shard:
                    return f"{prefix}.{expert}.{ckpt_part}.weight"
            return param_name
        if shard < 0:
            return param_name
        for ckpt_part, (merged, index) in self.packed.items():
            if index == shard and f".{merged}." in f".{param_name}":
                return param_name.replace(merged, ckpt_part)
        return param_name


def _persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every buffer `model.state_dict()` would save."""
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _safetensors_items(handle) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for each tensor of one open safetensors file."""
    for key in handle.keys():
        yield key, handle.get_slice(key)


def build_empty_model(config: ModelConfig) -> nn.Module:
    """The registered class for `config.model_type`, built with its parameters on the meta device
    (no memory, no initialisation) and its tied weights tied: what the loader fills, and what the
    planner counts parameters on. ValueError for an unregistered `model_type`."""
    model_cls = get_model_class(config.model_type)
    with init_empty_weights(include_buffers=False), _SkipRandomInit():
        model = model_cls(config)
    # init_empty_weights re-creates every assigned parameter, which unties shared ones: tie again
    # so the shared weight is expected (and loaded, and counted) once.
    model.tie_weights()
    return model


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ValueError, naming what does not divide, when `config`'s model cannot be split over
    `size` ranks (heads, KV heads, MLP or expert widths); builds it on the meta device, no process
    group needed, so the engine can ask before it starts any worker."""
    if size > 1:
        build_empty_model(dataclasses.replace(config, parallel=TensorParallel(rank=0, size=size, group=object())))


def load_model(
    model_name_or_path: str,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    progress: bool = True,
    parallel: TensorParallel = SINGLE,
    quantization: str = "none",
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
    on_layer_loaded: Callable[[int, nn.Module], None] | None = None,
) -> LoadedModel:
    """Build the model for a checkpoint and load its weights (this rank's share under `parallel`).

    `dtype` None keeps the checkpoint's dtype (fp32 if the config does not say). `quantization`
    "int8" or "int4" (groups of `quantization_group_size` input features) stores the decoder layers'
    linear weights quantized (`fastgen.models.quant`), each quantized as it is loaded.
    `on_layer_loaded(index, layer)` is called with each decoder layer as soon as all its tensors are
    in (before later tensors are read), so a caller may move it elsewhere (weight offload).
    """
    model_dir = resolve_model_dir(model_name_or_path)
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    config = ModelConfig.from_file(config_path)
    config.parallel = parallel
    get_model_class(config.model_type)  # an unsupported family fails before any weight file is opened
    gguf_file = gguf_format.gguf_source(model_dir)
    files = [] if gguf_file is not None else _safetensors_files(model_dir)
    dtype = parse_dtype(dtype) or config.dtype or torch.float32
    device = torch.device(device)

    model = build_empty_model(config)
    quantize_decoder_linears(model, quantization, dtype, quantization_group_size)
    sink = _WeightSink(model, dtype, device, on_layer_loaded)
    if gguf_file is not None:
        reader = gguf_format.tensor_index(model_dir, gguf_file) or gguf_format.open_gguf(gguf_file)
        tensors = gguf_format.iter_gguf_tensors(gguf_file, config.raw, reader)
        sources, total, name = [tensors], gguf_format.gguf_weight_count(reader), os.path.basename(gguf_file)
    else:
        handles = [safe_open(path, framework="pt", device="cpu") for path in files]
        sources = [_safetensors_items(f) for f in handles]
        total, name = sum(len(f.keys()) for f in handles), os.path.basename(os.path.normpath(model_dir))
    with tqdm(total=total, desc=f"loading {name}", unit="tensor", disable=not progress) as bar:
        for source in sources:
            for key, tensor in source:
                sink.put(key, tensor)
                bar.update(1)
    sink.check_complete()
    model.tie_weights()
    model.to(device)
    model.eval().requires_grad_(False)
    eos = load_generation_eos(model_dir) or config.eos_token_id
    return LoadedModel(model=model, config=config, model_dir=model_dir, eos_token_ids=eos)
