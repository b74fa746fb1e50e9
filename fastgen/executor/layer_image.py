"""One decoder layer's weights as a flat byte image, and the two places an offloaded image lives.

Weight offload (`fastgen.executor.offload`) moves a layer's weights as one block of bytes: each
parameter (and persistent buffer, e.g. a quantized linear's packed `qweight` and `scales`) gets an
aligned span of the image, and running the layer points its tensors at views of a buffer holding
the image; releasing it points them at empty placeholders, so the layer holds no weight memory.
The image is taken after the loader's merges, tensor-parallel sharding and quantization, so the
bytes streamed are exactly the bytes a resident layer would hold.

Sources: `HostSource` keeps each image in host memory (pinned on CUDA, so copies to the device run
asynchronously); `DiskSource` writes each once as a safetensors file in a fastgen-owned folder and
reads it back into a caller's buffer with `os.preadv` (plain reads rather than a memory map: the
page cache then holds the file, not this process, whose resident set stays within the budget).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass

import torch
from safetensors.torch import save_file
from torch import nn

ALIGN = 256
"""Byte alignment of each tensor in an image (what vectorised CPU and CUDA kernels want of their inputs)."""


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """One tensor of a layer and its span in the layer's image."""

    name: str
    """Path inside the layer ("self_attn.qkv_proj.weight"); the tensor's name in the disk file."""
    module: nn.Module
    """The module that holds the tensor."""
    attr: str
    """Its attribute name on `module`."""
    is_param: bool
    """A parameter (rebound through `.data`, so the Parameter object stays the same) or a buffer."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: torch.dtype
    """The tensor's dtype."""
    offset: int
    """First byte in the image (a multiple of `ALIGN`)."""
    nbytes: int
    """Bytes of the tensor."""


class LayerImage:
    """The weights one decoder layer owns, laid out in one flat byte buffer."""

    def __init__(self, index: int, slots: list[TensorSlot], nbytes: int, device: torch.device) -> None:
        self.index = index
        """Which decoder layer."""
        self.slots = slots
        """Its tensors in image order."""
        self.nbytes = nbytes
        """Bytes of the whole image (tensors plus alignment padding)."""
        # One empty tensor per slot: what the layer points at while it is not resident.
        self._placeholders = [torch.empty(0, dtype=s.dtype, device=device) for s in slots]

    @classmethod
    def of(cls, index: int, layer: nn.Module) -> "LayerImage":
        """The image layout of `layer`'s parameters and persistent buffers (non-persistent ones, such
        as rotary tables, are recomputable state, not weights: they stay where they are)."""
        slots, offset, device = [], 0, None
        for prefix, module in layer.named_modules():
            tensors = [(attr, t, True) for attr, t in module._parameters.items() if t is not None]
            tensors += [(attr, t, False) for attr, t in module._buffers.items()
                        if t is not None and attr not in module._non_persistent_buffers_set]
            for attr, tensor, is_param in tensors:
                device = tensor.device
                nbytes = tensor.numel() * tensor.element_size()
                name = f"{prefix}.{attr}" if prefix else attr
                slots.append(TensorSlot(name, module, attr, is_param, tuple(tensor.shape), tensor.dtype, offset,
                                        nbytes))
                offset += -(-nbytes // ALIGN) * ALIGN
        if not slots:
            raise ValueError(f"decoder layer {index} holds no weights to offload")
        return cls(index, slots, offset, device)

    def current(self) -> dict[str, torch.Tensor]:
        """The layer's tensors now, by slot name."""
        return {s.name: getattr(s.module, s.attr) for s in self.slots}

    def view(self, buffer: torch.Tensor, slot: TensorSlot) -> torch.Tensor:
        """`slot`'s tensor as a view of the image held in `buffer` (flat uint8)."""
        return buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)

    def bind(self, buffer: torch.Tensor) -> None:
        """Point the layer's tensors at the image in `buffer` (which must stay untouched while bound)."""
        for slot in self.slots:
            self._set(slot, self.view(buffer, slot))

    def release(self) -> None:
        """Point the layer's tensors at empty placeholders: the layer holds no weight bytes."""
        for slot, placeholder in zip(self.slots, self._placeholders):
            self._set(slot, placeholder)

    @staticmethod
    def _set(slot: TensorSlot, tensor: torch.Tensor) -> None:
        if slot.is_param:
            slot.module._parameters[slot.attr].data = tensor
        else:
            slot.module._buffers[slot.attr] = tensor


class HostSource:
    """Offloaded images in host memory: one flat copy per layer, pinned when the device is a GPU."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._images: dict[int, torch.Tensor] = {}

    def put(self, image: LayerImage, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of `tensors` (the layer's current weights) laid out as `image`."""
        host = torch.empty(image.nbytes, dtype=torch.uint8, pin_memory=self.pin)
        for slot in image.slots:
            image.view(host, slot).copy_(tensors[slot.name])
        self._images[image.index] = host

    def tensor(self, index: int) -> torch.Tensor:
        """Layer `index`'s host image (flat uint8)."""
        return self._images[index]

    def read_into(self, image: LayerImage, dest: torch.Tensor) -> None:
        """Copy layer `image.index` into the first `image.nbytes` of `dest` (synchronously)."""
        dest[: image.nbytes].copy_(self._images[image.index])

    def drop(self, index: int) -> None:
        """Forget layer `index` (it became resident)."""
        self._images.pop(index, None)

    def close(self) -> None:
        """Free every image."""
        self._images.clear()


class DiskSource:
    """Offloaded images as safetensors files (one per layer) in a folder this source owns: under
    $FASTGEN_CACHE/offload when set, else the system's temporary folder; removed by `close`."""

    def __init__(self) -> None:
        root = os.environ.get("FASTGEN_CACHE")
        parent = os.path.join(root, "offload") if root else None
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.directory = tempfile.mkdtemp(prefix="fastgen-offload-", dir=parent)
        """Where the layer files are written."""
        self._files: dict[int, tuple[int, dict[str, int]]] = {}  # index -> (fd, slot name -> file offset)

    def put(self, image: LayerImage, tensors: dict[str, torch.Tensor]) -> None:
        """Write `tensors` (the layer's current weights) to the layer's file."""
        path = os.path.join(self.directory, f"layer-{image.index:05d}.safetensors")
        save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, path)
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        start = 8 + header_len
        offsets = {name: start + header[name]["data_offsets"][0] for name in tensors}
        self._files[image.index] = (os.open(path, os.O_RDONLY), offsets)

    def read_into(self, image: LayerImage, dest: torch.Tensor) -> None:
        """Read layer `image.index` from its file into `dest` (flat uint8 on the CPU, pinned or not),
        laid out as `image`. Releases the GIL while the kernel copies, so it overlaps compute."""
        fd, offsets = self._files[image.index]
        memory = memoryview(dest.numpy())
        for slot in sorted(image.slots, key=lambda s: offsets[s.name]):
            _read_exactly(fd, memory[slot.offset : slot.offset + slot.nbytes], offsets[slot.name])

    def drop(self, index: int) -> None:
        """Forget layer `index` (it became resident) and delete its file."""
        entry = self._files.pop(index, None)
        if entry is not None:
            os.close(entry[0])
            os.unlink(os.path.join(self.directory, f"layer-{index:05d}.safetensors"))

    def close(self) -> None:
        """Close and delete every file, and the folder."""
        for fd, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def _read_exactly(fd: int, view: memoryview, offset: int) -> None:
    """Fill `view` from file `fd` at `offset` (a read may return fewer bytes than asked)."""
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise EOFError(f"offload file ended early at byte {offset}")
        view, offset = view[got:], offset + got
