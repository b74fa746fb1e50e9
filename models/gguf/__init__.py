"""GGUF checkpoints (llama.cpp's one-file format), loaded into our model classes.

A GGUF file holds the config (as llama.cpp metadata keys), the tokenizer (vocabulary, merges, chat
template) and the weights, usually quantized and in llama.cpp's layout. This package turns one
into what the rest of fastgen expects of a checkpoint:

- `metadata.gguf_config_dict` maps the metadata to a Hugging Face-style config dict;
- `files.prepare_gguf_dir` writes that config, a generation_config.json, the tokenizer (built by
  transformers, the field's standard for GGUF vocabularies) and the tensors' index (so later loads
  skip parsing the metadata) into a cache directory, plus a marker naming the file;
  `resolve_model_dir` returns that directory;
- `weights.iter_gguf_tensors` yields the weights one at a time under HF names, dequantized to fp32
  and put back into HF's layout (llama's Q/K rows un-permuted, Gemma's `1 + w` norms undone); the
  loader casts and places each before reading the next.
"""

from fastgen.models.gguf.files import (
    GGUF_SUFFIX,
    SOURCE_MARKER,
    TENSOR_INDEX,
    find_gguf_file,
    gguf_cache_dir,
    gguf_source,
    prepare_gguf_dir,
    tensor_index,
)
from fastgen.models.gguf.metadata import GGUF_FAMILIES, gguf_config_dict, llama3_rope_settings
from fastgen.models.gguf.reader import check_tensor_types, open_gguf
from fastgen.models.gguf.weights import gguf_weight_count, iter_gguf_tensors

__all__ = [
    "GGUF_FAMILIES",
    "GGUF_SUFFIX",
    "SOURCE_MARKER",
    "TENSOR_INDEX",
    "check_tensor_types",
    "find_gguf_file",
    "gguf_cache_dir",
    "gguf_config_dict",
    "gguf_source",
    "gguf_weight_count",
    "iter_gguf_tensors",
    "llama3_rope_settings",
    "open_gguf",
    "prepare_gguf_dir",
    "tensor_index",
]
