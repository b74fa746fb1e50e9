"""ZeRO-Inference-style weight offload: decoder layers stream onto the device one at a time.

A `WeightStreamer` owns which decoder layers are resident. Under a budget of resident weight bytes
(`RunnerSpec.weight_memory`, per device) it keeps the embeddings, LM head, norms and as many whole
layers as fit, plus a small pool of layer-sized buffers; every other layer's weights live in a
source (`offload="cpu"`: host memory; `"disk"`: a file) and are copied into a pool buffer just
before the layer runs, then released. While layer i computes, the next offloaded layers are
already on their way:

- on a GPU, copies run on a side CUDA stream from pinned host buffers, ordered by events (the
  compute stream waits for a layer's copy; a buffer is refilled only after the layer that used it
  finished); from disk a thread first reads the file into a pinned staging buffer;
- on the CPU, a thread reads the file (or copies the host image) into the buffer.

The same code runs on the CPU, where the "device" is the process's own memory: with "disk" the
resident weight bytes (and so the RSS) stay within the budget. "cpu" on a CPU device keeps the host
copy in that same RAM: it saves nothing and exists so the host-copy path runs in CI.

The streaming runs in forward hooks around each decoder layer, outside any compiled graph: with
compile on, the runner compiles each layer's own `forward` (its compute) rather than the module
call that runs the hooks. CUDA graphs cannot contain the streaming (host waits, events, a thread):
the plan turns them off with offload, and `install_offload` refuses them.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import ctypes.util
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from fastgen.executor.layer_image import DiskSource, HostSource, LayerImage
from fastgen.models.layers import decoder_layers
from fastgen.planning.plan import OFFLOAD_MODES

PREFETCH_DEPTH = 2
"""Pool buffers when the budget allows: the layer computing and the next one on its way."""

STREAMER_ATTR = "weight_streamer"
"""Attribute of a model loaded with offload that holds its `WeightStreamer` (until the runner installs it)."""


@dataclass(slots=True)
class OffloadStats:
    """What the streamer has done since it was installed."""

    budget_bytes: int
    """The device budget for weights."""
    resident_bytes: int
    """Weight bytes on the device now: the model's resident tensors and the pool buffers allocated."""
    peak_resident_bytes: int
    """High-water mark of `resident_bytes`."""
    resident_layers: int
    """Decoder layers that stay on the device."""
    streamed_layers: int
    """Decoder layers streamed every step."""
    pool_buffers: int
    """Layer-sized buffers the streamed layers take turns in."""
    bytes_per_step: int
    """Bytes one full forward pass moves (every streamed layer once)."""
    bytes_streamed: int = 0
    """Bytes moved onto the device so far."""
    transfers: int = 0
    """Layer copies so far."""
    transfer_seconds: float = 0.0
    """Time the copies took (on the copy thread or the side stream)."""
    wait_seconds: float = 0.0
    """Time compute stood waiting for a layer that had not arrived."""

    @property
    def overlap(self) -> float:
        """Share of the transfer time hidden behind compute (1 = compute never waited)."""
        if self.transfer_seconds <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.wait_seconds / self.transfer_seconds))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and persistent buffers as they are now, each storage once."""
    seen, total = set(), 0
    for tensor in model.state_dict(keep_vars=True).values():
        if tensor.numel() and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def plan_residency(static: int, sizes: list[int], budget: int) -> tuple[int, int]:
    """(R, P): keep the first R layers resident and stream the rest through P pool buffers, so that
    `static` (bytes outside the layers) + the R layers + P buffers of the largest streamed layer fit
    `budget`. Prefetch (P = 2) is worth more than one more resident layer; P = 1 only when nothing
    else fits. ValueError when not even one streamed layer at a time fits."""
    if static + sum(sizes) <= budget:
        return len(sizes), 0
    for depth in (PREFETCH_DEPTH, 1):
        for resident in range(len(sizes) - 1, -1, -1):
            pool = min(depth, len(sizes) - resident)
            if static + sum(sizes[:resident]) + pool * max(sizes[resident:]) <= budget:
                return resident, pool
    raise ValueError(f"weight_memory {budget:,} bytes cannot hold the {static:,} bytes that always stay resident "
                     f"(embeddings, LM head, norms) plus one streamed decoder layer ({max(sizes):,} bytes): "
                     f"raise it to at least {static + max(sizes):,}")


class WeightStreamer:
    """Owns the residency of a model's decoder layers under a weight budget, and streams the rest."""

    def __init__(self, mode: str, budget: int, device: torch.device) -> None:
        if mode not in ("cpu", "disk"):
            raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOAD_MODES))}, got {mode!r}")
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"weight_memory must be positive bytes with offload={mode!r}, got {budget!r}")
        self.mode, self.budget, self.device = mode, budget, device
        self.cuda = device.type == "cuda"
        self.source = HostSource(pin=self.cuda) if mode == "cpu" else DiskSource()
        self.images: dict[int, LayerImage] = {}
        self.stats: OffloadStats | None = None
        self._finalizer = weakref.finalize(self, self.source.close)

    def adopt(self, index: int, layer: nn.Module) -> None:
        """Move decoder layer `index`'s weights into the source and release them (the loader's
        `on_layer_loaded`, so the whole model never sits in memory at once)."""
        image = LayerImage.of(index, layer)
        self.source.put(image, image.current())
        image.release()
        self.images[index] = image

    def install(self, model: nn.Module) -> None:
        """Decide the resident layers, bring them back, and hook the streamed ones."""
        layers = decoder_layers(model)
        for index, layer in enumerate(layers):
            if index not in self.images:
                self.adopt(index, layer)
        _check_not_shared(model, layers, self.images)
        _return_freed_memory()
        static = weight_bytes(model)
        sizes = [self.images[i].nbytes for i in range(len(layers))]
        resident, pool = plan_residency(static, sizes, self.budget)
        for index in range(resident):
            buffer = torch.empty(sizes[index], dtype=torch.uint8, device=self.device)
            self._read_now(index, buffer)
            self.images[index].bind(buffer)
            self.source.drop(index)
        self.order = list(range(resident, len(layers)))
        """Streamed layers, in the order every forward pass runs them."""
        self.pool_size = pool
        self.buffer_bytes = max(sizes[resident:], default=0)
        self.pool: list[torch.Tensor | None] = [None] * pool
        self.free = list(range(pool))
        self.held: dict[int, int] = {}  # layer index -> pool slot (in flight or bound)
        self.jobs: dict[int, object] = {}  # layer index -> Future (thread) and/or CUDA event of its copy
        self.static_bytes = static + sum(sizes[:resident])
        self.stats = OffloadStats(self.budget, self.static_bytes, self.static_bytes, resident, len(self.order), pool,
                                  sum(sizes[resident:]))
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self._thread = None
        if self.order and not (self.cuda and self.mode == "cpu"):
            # A free function as initializer: the worker thread must not keep this streamer alive.
            init = (torch.cuda.set_device, (self.device,)) if self.cuda else (None, ())
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="fastgen-offload", initializer=init[0],
                                              initargs=init[1])
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _shutdown, self._thread, self.source)
        if self.cuda and self.order:
            self.side = torch.cuda.Stream(self.device)
            self.freed = [torch.cuda.Event() for _ in range(pool)]  # the buffer's last user finished
            self.staging: list[torch.Tensor | None] = [None] * pool  # pinned, for disk reads
            self.staged = [torch.cuda.Event() for _ in range(pool)]  # the staging buffer was copied out
        self._index = {id(layer): i for i, layer in enumerate(layers)}
        for index, layer in enumerate(layers if self.order else ()):
            if index >= resident:
                layer.register_forward_pre_hook(self._before)
                layer.register_forward_hook(self._after)
            else:  # a resident layer starts the next streamed layers early
                layer.register_forward_pre_hook(self._prefetch_from)

    # Hooks ---------------------------------------------------------------------------------

    def _prefetch_from(self, layer: nn.Module, args) -> None:
        self._fill(self._index[id(layer)])

    def _before(self, layer: nn.Module, args) -> None:
        index = self._index[id(layer)]
        if index not in self.held:
            if not self.free:
                self._drain()  # a step that failed midway left buffers held: start afresh
            self._request(index)
        start = time.perf_counter()
        job = self.jobs.pop(index, None)
        if isinstance(job, Future):
            job = job.result()
        if self.cuda:
            if job is not None:
                self._device_wait(job)
        else:
            self.stats.wait_seconds += time.perf_counter() - start
        self.images[index].bind(self.pool[self.held[index]])
        self._fill(index)

    def _after(self, layer: nn.Module, args, output) -> None:
        index = self._index[id(layer)]
        self.images[index].release()
        slot = self.held.pop(index)
        if self.cuda:
            self.freed[slot].record(torch.cuda.current_stream(self.device))
            self._fold_timings()
        self.free.append(slot)
        self._fill(index)

    # Streaming -----------------------------------------------------------------------------

    def _upcoming(self, after: int) -> list[int]:
        """Streamed layers in the order they run next, after layer `after` (wrapping into the next step)."""
        cut = bisect.bisect_right(self.order, after)
        return [i for i in self.order[cut:] + self.order[:cut] if i != after]

    def _fill(self, after: int) -> None:
        """Start copying the next streamed layers into every free buffer."""
        for index in self._upcoming(after)[: self.pool_size]:
            if not self.free:
                return
            if index not in self.held:
                self._request(index)

    def _request(self, index: int) -> None:
        """Take a free buffer for layer `index` and start its copy."""
        slot = self.free.pop()
        self.held[index] = slot
        if self.pool[slot] is None:
            with torch.inference_mode(False):  # a buffer outlives the step that allocated it
                self.pool[slot] = torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self.device)
            self.stats.resident_bytes += self.buffer_bytes
            self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)
        self.stats.bytes_streamed += self.images[index].nbytes
        self.stats.transfers += 1
        if self._thread is not None:
            self.jobs[index] = self._thread.submit(self._copy, index, slot)
        else:
            self.jobs[index] = self._copy(index, slot)

    def _copy(self, index: int, slot: int):
        """Bring layer `index` into pool buffer `slot` (on the copy thread, or enqueued on the side
        stream); returns the CUDA event that marks the copy done (None on the CPU)."""
        image = self.images[index]
        if not self.cuda:
            start = time.perf_counter()
            self.source.read_into(image, self.pool[slot])
            self.stats.transfer_seconds += time.perf_counter() - start  # only this thread adds here
            return None
        host = self.source.tensor(index) if self.mode == "cpu" else self._stage(image, slot)
        with torch.cuda.stream(self.side):
            self.side.wait_event(self.freed[slot])
            begin, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(self.side)
            self.pool[slot][: image.nbytes].copy_(host[: image.nbytes], non_blocking=True)
            done.record(self.side)
        if self.mode == "disk":
            self.staged[slot] = done
        self._timings.append((begin, done, False))
        return done

    def _stage(self, image: LayerImage, slot: int) -> torch.Tensor:
        """Read `image` from disk into slot's pinned staging buffer, once its last copy to the device is done."""
        if self.staging[slot] is None:
            self.staging[slot] = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=True)
        self.staged[slot].synchronize()
        self.source.read_into(image, self.staging[slot])
        return self.staging[slot]

    def _device_wait(self, done: torch.cuda.Event) -> None:
        """Make the compute stream wait for a copy, timing how long it stood (on the device)."""
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(done)
        after.record(stream)
        self._timings.append((before, after, True))

    def _fold_timings(self) -> None:
        """Add the finished CUDA timings to the stats (without waiting for unfinished ones)."""
        while self._timings and self._timings[0][1].query():
            begin, end, is_wait = self._timings.pop(0)
            seconds = begin.elapsed_time(end) / 1000
            if is_wait:
                self.stats.wait_seconds += seconds
            else:
                self.stats.transfer_seconds += seconds

    def _drain(self) -> None:
        """Wait for every copy in flight and give back every buffer."""
        for job in list(self.jobs.values()):
            if isinstance(job, Future):
                job.result()
        self.jobs.clear()
        for index in list(self.held):
            self.images[index].release()
        self.free = list(range(self.pool_size))
        self.held.clear()

    def _read_now(self, index: int, buffer: torch.Tensor) -> None:
        """Copy layer `index` from the source into `buffer` synchronously (resident layers, once)."""
        image = self.images[index]
        if buffer.device.type == "cpu":
            self.source.read_into(image, buffer)
        else:
            staging = torch.empty(image.nbytes, dtype=torch.uint8)
            self.source.read_into(image, staging)
            buffer.copy_(staging)

    def snapshot(self) -> OffloadStats:
        """The stats so far (on CUDA after waiting for the copies and waits in flight to finish timing)."""
        if self.cuda and self._timings:
            torch.cuda.synchronize(self.device)
            self._fold_timings()
        return dataclasses.replace(self.stats)

    def close(self) -> None:
        """Stop the copy thread and delete the source (its files on disk)."""
        self._finalizer()


def new_streamer(spec, device: torch.device) -> WeightStreamer | None:
    """The streamer `spec`'s plan asks for (None with offload "none"), for the loader to hand layers to."""
    if spec.plan.offload == "none":
        return None
    return WeightStreamer(spec.plan.offload, spec.plan.weight_memory, device)


def install_offload(model: nn.Module, spec, device: torch.device) -> WeightStreamer | None:
    """Install the weight streamer of `spec` on `model` (the one its loader filled, else a new one that
    takes the loaded layers now); None with offload "none". ValueError with CUDA graphs."""
    offload = spec.plan.offload
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOAD_MODES))}, got {offload!r}")
    if offload == "none":
        return None
    if spec.plan.cuda_graphs:
        raise ValueError(f"offload={offload!r} needs cuda_graphs=False: layers stream between the layers' "
                         "compute (host waits, events, a copy thread), which a captured graph cannot contain")
    streamer = model.__dict__.pop(STREAMER_ATTR, None) or new_streamer(spec, device)
    streamer.install(model)
    return streamer


def _check_not_shared(model: nn.Module, layers: nn.ModuleList, images: dict[int, LayerImage]) -> None:
    """Raise if an offloaded parameter is also reachable outside its layer (it would vanish there too)."""
    owner = {id(s.module._parameters[s.attr]): i for i, image in images.items() for s in image.slots if s.is_param}
    prefix = next(name for name, module in model.named_modules() if module is layers) + "."
    for name, param in model.named_parameters(remove_duplicate=False):
        index = owner.get(id(param))
        if index is not None and not name.startswith(f"{prefix}{index}."):
            raise ValueError(f"{name} is shared with decoder layer {index}, which offload would take away from it: "
                             "weights shared across layers cannot be offloaded")


def _return_freed_memory() -> None:
    """Hand the freed layers' heap pages back to the OS: glibc keeps freed pages of its heap mapped,
    so the process RSS would still count weights that now live in the source."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass  # not glibc: nothing to trim, or no way to


def _shutdown(thread: ThreadPoolExecutor, source) -> None:
    # No wait: the last reference may go on the copy thread itself, which cannot join itself; no copy
    # is in flight by then (a queued copy would keep the streamer alive).
    thread.shutdown(wait=False)
    source.close()
