"""Reading GGUF files with the `gguf` package: metadata values, tensor types, dequantized tensors.

The package is imported only when a GGUF file is loaded, so fastgen works without it otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def import_gguf():
    """The `gguf` package, or an ImportError saying how to get it."""
    try:
        import gguf
    except ImportError as exc:
        raise ImportError("loading a .gguf checkpoint needs the `gguf` package: pip install gguf") from exc
    return gguf


def open_gguf(path: str):
    """A memory-mapped `gguf.GGUFReader` for `path`, with a clear error for a file that is not GGUF."""
    try:
        return import_gguf().GGUFReader(path, "r")
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(field) -> Any:
    """A metadata field as a Python value (str, int, float, bool or a list of them)."""
    gguf = import_gguf()
    kinds = field.types

    def one(index: int, kind) -> Any:
        part = field.parts[index]
        if kind == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        value = part[0].item()
        return bool(value) if kind == gguf.GGUFValueType.BOOL else value

    if kinds[0] == gguf.GGUFValueType.ARRAY:
        return [one(i, kinds[-1]) for i in field.data]
    return one(field.data[0], kinds[0])


class Metadata:
    """Lookups into a reader's metadata, parsed on demand (token lists stay unparsed)."""

    def __init__(self, reader, path: str) -> None:
        self.fields = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key`, or `default` when the file lacks it."""
        field = self.fields.get(key)
        return default if field is None else field_value(field)

    def require(self, key: str) -> Any:
        """The value of `key`, or a ValueError naming the missing key."""
        if key not in self.fields:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
        return self.get(key)

    def uniform(self, key: str, default: Any = None) -> Any:
        """A per-model value that some files store per layer: the one value, or an error if layers differ."""
        value = self.get(key, default) if default is not None else self.require(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"{self.path}: {key} differs between layers ({value}); fastgen needs one value")
            value = value[0]
        return value


def can_dequantize(qtype) -> bool:
    """Whether the `gguf` package dequantizes tensors of `qtype` (tried on one zero block)."""
    gguf = import_gguf()
    sizes = gguf.GGML_QUANT_SIZES.get(qtype)
    if sizes is None:
        return False
    block, nbytes = sizes
    if qtype == gguf.GGMLQuantizationType.F32:
        probe = np.zeros((1, block), np.float32)
    elif qtype == gguf.GGMLQuantizationType.F16:
        probe = np.zeros((1, block), np.float16)
    else:
        probe = np.zeros((1, nbytes), np.uint8)
    try:
        gguf.quants.dequantize(probe, qtype)
    except NotImplementedError:
        return False
    return True


def check_tensor_types(reader, path: str) -> None:
    """Raise naming every tensor type (and its tensors) that the `gguf` package cannot dequantize."""
    by_type: dict[Any, list[str]] = {}
    for tensor in reader.tensors:
        by_type.setdefault(tensor.tensor_type, []).append(tensor.name)
    unsupported = []
    for qtype, names in by_type.items():
        if not can_dequantize(qtype):
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            unsupported.append(f"{getattr(qtype, 'name', qtype)} ({shown})")
    if unsupported:
        raise ValueError(f"{path}: tensor type(s) fastgen cannot dequantize: {'; '.join(unsupported)}. Supported "
                         "include F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K..Q6_K")


def torch_shape(tensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch order (ggml lists the fastest-varying dimension first)."""
    return tuple(int(d) for d in reversed(tensor.shape))


def tensor_values(tensor) -> np.ndarray:
    """A GGUF tensor dequantized to fp32, in PyTorch shape order."""
    values = import_gguf().quants.dequantize(tensor.data, tensor.tensor_type).reshape(torch_shape(tensor))
    return values if values.flags.writeable else values.copy()  # F32 comes back as a read-only memmap view


@dataclass(frozen=True, slots=True)
class IndexedTensor:
    """One tensor of a GGUF file found through its `TensorIndex`: what the loader reads of a
    `gguf.ReaderTensor` (name, ggml type, ggml-order shape, memory-mapped data)."""

    name: str
    tensor_type: Any
    """Its `gguf.GGMLQuantizationType`."""
    shape: list[int]
    """Its dimensions in ggml order (fastest-varying first), as `ReaderTensor.shape`."""
    data: np.ndarray
    """Its bytes or values, memory-mapped, shaped as `ReaderTensor.data`."""


@dataclass(frozen=True, slots=True)
class TensorIndex:
    """What loading needs of a GGUF file without parsing its metadata: the architecture and where each
    tensor lies. `gguf.GGUFReader` parses every metadata field, the vocabulary and merges included (~2 s for
    SmolLM2-135M's 49152-token vocabulary on a 2-core EPYC); the index, written once when the file's
    directory is prepared, takes milliseconds."""

    architecture: str
    tensors: list[IndexedTensor]


def tensor_index_entries(reader, architecture: str) -> dict:
    """A reader's tensors as the JSON `read_tensor_index` takes: name, type, shape, file offset, data layout."""
    return {"architecture": architecture,
            "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                         "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
                        for t in reader.tensors]}


def read_tensor_index(path: str, entries: dict) -> TensorIndex:
    """The `TensorIndex` of the GGUF file at `path` from its `tensor_index_entries`, the data memory-mapped."""
    gguf = import_gguf()
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = []
    for e in entries["tensors"]:
        dtype = np.dtype(e["dtype"])
        size = int(np.prod(e["data_shape"])) * dtype.itemsize
        data = raw[e["offset"]: e["offset"] + size].view(dtype).reshape(e["data_shape"])
        tensors.append(IndexedTensor(e["name"], gguf.GGMLQuantizationType(e["type"]), e["shape"], data))
    return TensorIndex(entries["architecture"], tensors)
