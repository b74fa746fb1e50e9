"""A GGUF file as a checkpoint directory: where it is, and its prepared config and tokenizer.

`prepare_gguf_dir` writes config.json, generation_config.json and the tokenizer files into a cache
directory (never next to the GGUF file), plus a marker naming the file, whose weights the loader
then reads directly. Every consumer of a checkpoint directory (engine, policy, `fastgen.planning`,
tensor-parallel workers) reads it unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile

from fastgen.models.gguf.metadata import family_of, gguf_config_dict
from fastgen.models.gguf.reader import Metadata, TensorIndex, open_gguf, read_tensor_index, tensor_index_entries
from fastgen.ops.cache_dir import fastgen_cache_dir

logger = logging.getLogger("fastgen")

GGUF_SUFFIX = ".gguf"
"""File name ending of a GGUF checkpoint."""

SOURCE_MARKER = "gguf_source.json"
"""File in a prepared directory naming the GGUF file it stands for."""

TENSOR_INDEX = "gguf_tensors.json"
"""File in a prepared directory listing the GGUF file's architecture and tensors (`TensorIndex`)."""

# Bump when the files written by `prepare_gguf_dir` change, so older cache entries are not reused.
_CACHE_FORMAT = 2


def find_gguf_file(path: str) -> str | None:
    """The GGUF file `path` stands for: `path` itself if it is a .gguf file, or the only .gguf file of a
    directory without safetensors weights; None when `path` is not a GGUF checkpoint.

    A directory holding several .gguf files is ambiguous and raises, naming them.
    """
    if os.path.isfile(path):
        return path if path.endswith(GGUF_SUFFIX) else None
    if not os.path.isdir(path):
        return None
    names = os.listdir(path)
    if SOURCE_MARKER in names or any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        return None
    ggufs = sorted(n for n in names if n.endswith(GGUF_SUFFIX))
    if len(ggufs) > 1:
        raise ValueError(f"{path} holds {len(ggufs)} GGUF files ({', '.join(ggufs)}); pass the path of the one to load")
    return os.path.join(path, ggufs[0]) if ggufs else None


def gguf_cache_dir() -> str:
    """Where prepared GGUF directories live: $FASTGEN_CACHE, else $XDG_CACHE_HOME/fastgen, else ~/.cache/fastgen."""
    return os.path.join(fastgen_cache_dir(), "gguf")


def _file_identity(path: str) -> dict:
    """What identifies one version of a file: its real path, size and modification time."""
    stat = os.stat(path)
    return {"gguf_file": os.path.realpath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "format": _CACHE_FORMAT}


def gguf_source(model_dir: str) -> str | None:
    """The GGUF file a prepared directory stands for (None for an ordinary checkpoint directory).

    Raises if the file is gone or has changed since the directory was prepared.
    """
    marker = os.path.join(model_dir, SOURCE_MARKER)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        recorded = json.load(f)
    path = recorded["gguf_file"]
    if not os.path.isfile(path) or _file_identity(path) != recorded:
        raise FileNotFoundError(f"{model_dir} was prepared from {path}, which is gone or has changed since; "
                                "load the .gguf file again")
    return path


def tensor_index(model_dir: str, gguf_path: str) -> TensorIndex | None:
    """The `TensorIndex` a prepared directory holds for its GGUF file (`gguf_source` has checked that the
    file is unchanged), or None for a directory without one."""
    index = os.path.join(model_dir, TENSOR_INDEX)
    if not os.path.isfile(index):
        return None
    with open(index, encoding="utf-8") as f:
        return read_tensor_index(gguf_path, json.load(f))


def prepare_gguf_dir(gguf_path: str) -> str:
    """A directory that stands for the GGUF file: config.json, generation_config.json and the tokenizer
    files, the file's `TensorIndex`, plus a marker naming the file (whose weights `load_model` reads
    directly).

    Built once per file version in `gguf_cache_dir()`; later calls only check it. Concurrent callers
    (serving replicas) are safe: each builds in a temporary directory and the first rename wins.
    """
    identity = _file_identity(gguf_path)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path)[: -len(GGUF_SUFFIX)]
    target = os.path.join(gguf_cache_dir(), f"{stem}-{digest}")
    if os.path.isfile(os.path.join(target, SOURCE_MARKER)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    logger.info("fastgen: reading GGUF metadata and tokenizer of %s into %s (once per file)", gguf_path, target)
    scratch = tempfile.mkdtemp(prefix=".partial-", dir=os.path.dirname(target))
    try:
        reader = open_gguf(gguf_path)
        config = gguf_config_dict(gguf_path, reader)
        _write_json(os.path.join(scratch, "config.json"), config)
        _write_json(os.path.join(scratch, "generation_config.json"),
                    _generation_config(Metadata(reader, gguf_path), config))
        architecture, _ = family_of(Metadata(reader, gguf_path))
        _write_json(os.path.join(scratch, TENSOR_INDEX), tensor_index_entries(reader, architecture))
        del reader  # its parsed metadata holds the whole vocabulary; transformers reads the file itself
        _convert_tokenizer(gguf_path).save_pretrained(scratch)
        _write_json(os.path.join(scratch, SOURCE_MARKER), identity)  # last: it marks the directory complete
        try:
            os.rename(scratch, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, SOURCE_MARKER)):
                raise  # not a lost race with another process: a real failure
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _generation_config(meta: Metadata, config: dict) -> dict:
    """EOS ids as llama.cpp ends generation: EOS, end-of-turn and end-of-message where the file has them."""
    eos = [config.get("eos_token_id")] + [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))
    out = {"bos_token_id": config.get("bos_token_id"), "pad_token_id": config.get("pad_token_id")}
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return out


def _convert_tokenizer(path: str):
    """The HF fast tokenizer (with chat template) transformers builds from the file's vocabulary."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers raises several types for files it cannot read
        # AutoTokenizer first rebuilds the model config, which transformers can do only for some
        # architectures (not Gemma 1); the fast-tokenizer class reads the vocabulary alone.
        try:
            return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
        except Exception:
            raise ValueError(f"{path}: transformers cannot build a tokenizer from this GGUF file's vocabulary "
                             f"({type(exc).__name__}: {exc})") from exc


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
