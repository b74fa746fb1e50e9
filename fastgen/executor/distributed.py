"""Tensor-parallel ranks: starting them, sending them each step, and noticing when one dies.

Rank 0 is the engine: it alone schedules, samples and detokenizes. Every other rank holds its
share of the weights and of the KV cache and runs the same step as rank 0, so the collectives in
the model line up. Per step rank 0 sends only the flat integer inputs (`HostStepInputs`: token
ids, positions, slots, block tables, ...) as two tensor broadcasts over a gloo group, a header
and one payload; no sequence object is pickled. The runner spec (checkpoint, plan, KV blocks) is
pickled once, at start.

Ranks come from one of two places:
- `tensor_parallel=N` in a normal process: rank 0 starts N-1 worker processes
  (`python -m fastgen.executor.tp_worker`, fresh interpreters, so a user's script is never re-imported)
  and meets them through a TCP store on a free port;
- a `torchrun` launch (the environment has RANK/WORLD_SIZE): every process calls
  `fastgen.pipeline` or `scripts/serve.py`; rank 0 becomes the engine, the others serve it.

A dead worker closes its sockets, so rank 0's next collective fails at once; rank 0 then names
the rank, its exit status and the last line of its error, and refuses further steps.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastgen.models.parallel import TensorParallel
from fastgen.executor.runner import RunnerSpec
from fastgen.executor.step_inputs import HostStepInputs

logger = logging.getLogger("fastgen")

CMD_STEP = 1
CMD_SHUTDOWN = 2
CMD_LORA = 3
_HEADER_LEN = 5  # command, then the sizes `HostStepInputs.pack` writes


@dataclass(frozen=True, slots=True)
class LoRASlotWrite:
    """Rank 0 wrote LoRA device slot `slot` (adapter `name` read from `path`; both None: emptied), and so
    must every other rank, from its own read of the adapter, before the next step."""

    slot: int
    """The device slot."""
    name: str | None
    """The adapter's name (None: the slot was emptied)."""
    path: str | None
    """Its PEFT directory, which every rank must be able to read (None: emptied)."""

COLLECTIVE_TIMEOUT_S = float(os.environ.get("FASTGEN_TP_TIMEOUT", "600"))
"""Seconds a collective may wait for a rank that is alive but silent (a dead one fails at once).
Long enough for a slow rank to compile a bucket during warm-up."""


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed; the engine cannot step any more."""


@dataclass(slots=True, frozen=True)
class TorchrunEnv:
    """This process's place in a `torchrun` launch."""

    rank: int
    """Global rank."""
    world_size: int
    """Processes in the launch."""
    local_rank: int
    """Rank on this machine (its CUDA device index)."""


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun launch this process belongs to, None when not launched by torchrun."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    try:
        return TorchrunEnv(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                           int(os.environ.get("LOCAL_RANK", 0)))
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"torchrun environment is incomplete or malformed ({exc}): need RANK and WORLD_SIZE") from exc


def backend_for(device_type: str) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device_type == "cuda" else "gloo"


def rank_device(device_type: str, device_index: int, rank: int, env: TorchrunEnv | None) -> torch.device:
    """The device of `rank`: its LOCAL_RANK GPU under torchrun, else `device_index + rank`."""
    if device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank if env is not None else device_index + rank)


def metadata_group(device_type: str):
    """The group the step inputs travel on: gloo over host memory (the default group on a CPU)."""
    return dist.new_group(backend="gloo") if device_type == "cuda" else dist.group.WORLD


class StepChannel:
    """Rank 0 broadcasts commands and step inputs; the other ranks receive them."""

    def __init__(self, group) -> None:
        self.group = group
        self.src = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0

    def send_step(self, host: HostStepInputs) -> None:
        """Rank 0: send one step."""
        header, payload = host.pack(CMD_STEP)
        dist.broadcast(header, self.src, group=self.group)
        dist.broadcast(payload, self.src, group=self.group)

    def send_lora_writes(self, writes: list[LoRASlotWrite]) -> None:
        """Rank 0: tell the other ranks which LoRA slots to write before the next step."""
        dist.broadcast(torch.tensor([CMD_LORA] + [0] * (_HEADER_LEN - 1), dtype=torch.int64), self.src,
                       group=self.group)
        dist.broadcast_object_list([writes], self.src, group=self.group)

    def send_shutdown(self) -> None:
        """Rank 0: tell the other ranks to stop."""
        dist.broadcast(torch.tensor([CMD_SHUTDOWN] + [0] * (_HEADER_LEN - 1), dtype=torch.int64), self.src,
                       group=self.group)

    def receive(self) -> HostStepInputs | list[LoRASlotWrite] | None:
        """Other ranks: the next step, LoRA slot writes to make before it, or None when rank 0 says stop."""
        header = torch.empty(_HEADER_LEN, dtype=torch.int64)
        dist.broadcast(header, self.src, group=self.group)
        values = header.tolist()
        if values[0] == CMD_SHUTDOWN:
            return None
        if values[0] == CMD_LORA:
            box: list = [None]
            dist.broadcast_object_list(box, self.src, group=self.group)
            return box[0]
        if values[0] != CMD_STEP:
            raise RuntimeError(f"unknown tensor-parallel command {values[0]} from rank 0")
        payload = torch.empty(HostStepInputs.payload_size(values), dtype=torch.int64)
        dist.broadcast(payload, self.src, group=self.group)
        return HostStepInputs.unpack(values, payload)

    def broadcast_spec(self, spec: RunnerSpec | None) -> RunnerSpec:
        """Rank 0 sends the worker spec (pickled once); the others receive it."""
        box = [spec]
        dist.broadcast_object_list(box, self.src, group=self.group)
        return box[0]


def worker_up_key(rank: int) -> str:
    """The store key a spawned worker sets once it has started and reached rank 0's store."""
    return f"fastgen/worker{rank}/up"


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class TensorParallelGroup:
    """Rank 0's side of a tensor-parallel group: the ranks' process group, workers, and step channel."""

    def __init__(self, size: int, device_type: str, device_index: int) -> None:
        """Join (torchrun) or start (N-1 worker processes) a group of `size` ranks with this process as rank 0."""
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine is already running in this process: destroy() it "
                               "before starting another (torch.distributed has one default group per process)")
        self.size = size
        self.workers: dict[int, subprocess.Popen] = {}
        self._error_dir = tempfile.mkdtemp(prefix="fastgen-tp-")
        self._failure: TensorParallelError | None = None
        self._closed = False
        backend = backend_for(device_type)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        env = torchrun_env()
        if env is not None:
            if env.rank != 0:
                raise RuntimeError(f"torchrun rank {env.rank} must serve rank 0 (fastgen.executor.tp_worker), not build an engine")
            if env.world_size != size:
                raise ValueError(f"torchrun started {env.world_size} processes but tensor_parallel is {size}: "
                                 "they must match (one rank per process)")
            dist.init_process_group(backend, init_method="env://", rank=0, world_size=size, timeout=timeout)
        else:
            store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False, timeout=timeout)
            try:
                for rank in range(1, size):
                    self.workers[rank] = self._spawn(rank, store.port, backend, device_type, device_index)
                self._wait_for_workers(store)
                dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=timeout)
            except BaseException:
                self._kill_workers()
                raise
        self.parallel = TensorParallel(rank=0, size=size, group=dist.group.WORLD)
        self.channel = StepChannel(metadata_group(device_type))

    def _spawn(self, rank: int, port: int, backend: str, device_type: str, device_index: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "fastgen.executor.tp_worker", "--rank", str(rank), "--world-size", str(self.size),
               "--store-port", str(port), "--backend", backend, "--device-type", device_type,
               "--error-file", self.error_file(rank), "--parent-pid", str(os.getpid())]
        logger.info("fastgen: starting tensor-parallel worker rank %d", rank)
        # Own session: a Ctrl-C in the user's terminal reaches rank 0, which then stops the workers.
        return subprocess.Popen(cmd, start_new_session=True)

    def _wait_for_workers(self, store: dist.TCPStore) -> None:
        """Wait until every worker has reached the store, failing at once if one dies on the way
        (an import error, say) instead of waiting out the rendezvous timeout."""
        keys = [worker_up_key(rank) for rank in self.workers]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel workers did not start within {COLLECTIVE_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def error_file(self, rank: int) -> str:
        """Where worker `rank` writes its error before exiting."""
        return os.path.join(self._error_dir, f"rank{rank}.err")

    def send_spec(self, spec: RunnerSpec) -> None:
        """Tell every worker what to build."""
        self._guard(lambda: self.channel.broadcast_spec(spec))

    def send_lora_writes(self, writes: list[LoRASlotWrite]) -> None:
        """Have every worker write these LoRA slots as rank 0 did (before the step that needs them)."""
        self._guard(lambda: self.channel.send_lora_writes(writes))

    def run_step(self, host: HostStepInputs, execute: Callable[[HostStepInputs], torch.Tensor | None]):
        """Send a step to every worker, then run rank 0's share with `execute`; returns its result."""
        def step():
            self.channel.send_step(host)
            return execute(host)

        return self._guard(step)

    def _guard(self, action):
        self.check_alive()
        try:
            return action()
        except Exception as exc:
            raise self.failure(exc) from exc
        except BaseException as exc:
            # Interrupted mid-step (Ctrl-C): the workers are inside a step rank 0 left, so the ranks'
            # collectives would no longer pair up. The group is unusable; say so on the next call.
            self.failure(exc)
            raise

    def check_alive(self) -> None:
        """Raise `TensorParallelError` if a worker has died (or an earlier failure stopped the group)."""
        if self._failure is not None:
            raise self._failure
        for rank, proc in self.workers.items():
            if proc.poll() is not None:
                raise self.failure(None)

    def failure(self, exc: BaseException | None) -> TensorParallelError:
        """The error that describes why the group failed (remembered: later steps raise it too)."""
        if self._failure is not None:
            return self._failure
        dead = {}
        for rank, proc in self.workers.items():
            try:
                code = proc.wait(timeout=2) if exc is not None else proc.poll()
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                dead[rank] = code
        if isinstance(exc, BaseException) and not isinstance(exc, Exception):
            message = f"a step was interrupted ({type(exc).__name__}), leaving the ranks out of step"
        elif dead:
            parts = []
            for rank, code in sorted(dead.items()):
                detail = self._last_error(rank)
                parts.append(f"rank {rank} (pid {self.workers[rank].pid}) {_describe_exit(code)}"
                             + (f": {detail}" if detail else ""))
            message = "tensor-parallel worker " + "; ".join(parts)
        else:
            message = f"a tensor-parallel step failed: {type(exc).__name__}: {exc}"
        self._failure = TensorParallelError(message + " (the engine is stopped; create a new one)")
        return self._failure

    def _last_error(self, rank: int) -> str:
        try:
            with open(self.error_file(rank), encoding="utf-8") as f:
                lines = [line.strip() for line in f if line.strip()]
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers and leave the process group (idempotent).

        `graceful` asks the workers to stop between steps; pass False when they may be anywhere
        else (loading, warming up), where only killing them is safe.
        """
        if self._closed:
            return
        self._closed = True
        if graceful and self._failure is None:
            try:
                self.check_alive()
                self.channel.send_shutdown()
            except Exception as exc:
                logger.warning("fastgen: tensor-parallel shutdown message failed: %s", exc)
        for proc in self.workers.values():
            try:
                proc.wait(timeout=10 if graceful and self._failure is None else 0.1)
            except subprocess.TimeoutExpired:
                pass
        self._kill_workers()
        shutil.rmtree(self._error_dir, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_workers(self) -> None:
        for proc in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
