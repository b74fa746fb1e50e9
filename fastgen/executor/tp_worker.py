"""A tensor-parallel rank other than 0: load this rank's shard, then run every step rank 0 sends.

Started by rank 0 as `python -m fastgen.executor.tp_worker --rank R ...` (see `distributed.py`), or entered
from `fastgen.pipeline` / `scripts/serve.py` on ranks > 0 of a `torchrun` launch. The worker builds
the same `ModelRunner` as rank 0 (same buckets, same warm-up order, so the collectives of
compilation and capture line up) and never samples: its share of the logits goes to rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from fastgen.executor.distributed import (COLLECTIVE_TIMEOUT_S, LoRASlotWrite, StepChannel, TorchrunEnv, backend_for,
                                          metadata_group, rank_device, worker_up_key)
from fastgen.executor.runner import ModelRunner, load_for_spec
from fastgen.models.lora import load_lora_adapter
from fastgen.models.parallel import TensorParallel

logger = logging.getLogger("fastgen")


def serve_rank(rank: int, world_size: int, device_type: str, env: TorchrunEnv | None) -> None:
    """Run rank `rank` (> 0) until rank 0 says stop. The default process group must already exist."""
    channel = StepChannel(metadata_group(device_type))
    spec = channel.broadcast_spec(None)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = rank_device(spec.device_type, spec.device_index, rank, env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    parallel = TensorParallel(rank=rank, size=world_size, group=dist.group.WORLD)
    loaded = load_for_spec(spec, device, parallel)
    runner = ModelRunner(loaded.model, loaded.config, dataclasses.replace(spec, progress=False), device)
    while (message := channel.receive()) is not None:
        if isinstance(message, list):
            write_lora_slots(runner, message, spec.plan.dtype)
        else:
            runner.execute(message)


def write_lora_slots(runner: ModelRunner, writes: list[LoRASlotWrite], dtype: torch.dtype) -> None:
    """Make rank 0's LoRA slot writes on this rank: each adapter read from its directory again, this
    rank's share kept (`LoRALinear.set_slot`)."""
    for write in writes:
        adapter = None if write.name is None else load_lora_adapter(write.name, write.path, runner.model,
                                                                    runner.lora.max_rank, dtype)
        runner.lora.write(write.slot, adapter)


def serve_torchrun_rank(env: TorchrunEnv, device_type: str) -> None:
    """Ranks > 0 of a torchrun launch: join the group, serve rank 0, leave when it stops.

    SIGTERM does not stop this rank (`_sigterm_deferred`): torchrun forwards it to every rank, and rank 0
    drains on it, stepping its requests in flight, which needs every rank. This rank leaves when rank 0
    shuts the group down, or when rank 0 dies (its next collective fails); torchrun's
    `--shutdown-timeout` SIGKILLs whatever is still running after that many seconds.
    """
    backend = backend_for(device_type)
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        with _sigterm_deferred(env.rank):
            serve_rank(env.rank, env.world_size, device_type, env)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _sigterm_deferred(rank: int) -> Iterator[None]:
    """While serving, SIGTERM is noted (logged), not acted on; the previous handler is back afterwards.

    Not re-raised at the end either: the rank is leaving by then, which is what SIGTERM asked for. Only
    the main thread can set a handler; elsewhere (a rank served from a thread) SIGTERM keeps its handler.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: Any) -> None:
        logger.warning("fastgen: tensor-parallel rank %d got SIGTERM; it keeps serving rank 0 until rank 0 "
                       "shuts the group down (it drains first)", rank)

    previous = signal.signal(signal.SIGTERM, note)
    # Restart interrupted system calls: the signal must not break a collective this rank is waiting in.
    signal.siginterrupt(signal.SIGTERM, False)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_with_parent(parent_pid: int) -> None:
    """Stop this worker when rank 0's process is gone, even if no collective is pending to notice it."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker started by rank 0."""
    parser = argparse.ArgumentParser(description="fastgen tensor-parallel worker (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--device-type", required=True)
    parser.add_argument("--error-file", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    logging.basicConfig(level=logging.WARNING, format=f"[fastgen rank {args.rank}] %(message)s")
    try:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, is_master=False, timeout=timeout)
        store.set(worker_up_key(args.rank), "1")
        dist.init_process_group(args.backend, store=store, rank=args.rank, world_size=args.world_size,
                                timeout=timeout)
        serve_rank(args.rank, args.world_size, args.device_type, None)
    except BaseException as exc:
        with open(args.error_file, "w", encoding="utf-8") as f:
            f.write(traceback.format_exc())
            f.write(f"\n{type(exc).__name__}: {exc}\n")
        traceback.print_exc()
        return 1
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
