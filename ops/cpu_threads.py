"""How many CPU threads a step runs on when other processes want the same cores.

A CPU step is ~1,000 parallel regions, each ending at a barrier that every OpenMP thread must reach. When a
thread of the team has lost its core to another runnable process, the others wait at the barrier until the
scheduler gives it back, one time slice later; a step whose team fills every core then runs several times
slower than on one thread fewer. Measured on a 2-core EPYC (SmolLM2-135M bf16, a burst of 16 prompts of 286
tokens, one busy process beside the engine): 8.8-10.9 s at 2 threads against 5.3 s at 1 (2.4 s at 2 alone).
A load generator, a co-located API process or a build is such a process.

`ThreadGovernor` decides before each step, from what is runnable at that moment: `/proc/loadavg` counts the
machine's runnable tasks, `/proc/self/task/*/stat` which of them are this process's own threads (the team,
workers still spinning after the last region, a server thread), which are not counted. The step gets the
cores the other processes leave free, at least one, at most the thread count the process started with. The
count holds for the step only: `restore()` gives the caller back its threads.

It is a plan option that is off unless asked for (`adaptive_threads`): one sample cannot tell a process that
keeps a core busy from one that runs for a millisecond, and where the others are brief the step gives up a
core it would have had. Beside guidellm's client, whose processes wake at each step's tokens, it measured
slower than a fixed team (see the plan's reason).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import BinaryIO

import torch

LOADAVG = "/proc/loadavg"
"""Linux's load line; its fourth field is `running/total`, the runnable tasks of the whole machine now."""

TASK_DIR = "/proc/self/task"
"""One directory per thread of this process, each with the `stat` line that holds its scheduler state."""

TASK_REFRESH_S = 0.5
"""Seconds a list of this process's threads is trusted before it is listed again (threads come and go
rarely; listing costs more than reading)."""


def adaptive_threads_supported() -> bool:
    """Whether this OS shows the runnable-task counts the governor reads (Linux's procfs)."""
    return sys.platform.startswith("linux") and os.path.exists(LOADAVG) and os.path.isdir(TASK_DIR)


def step_threads(max_threads: int, cores: int, running: int, own_running: int) -> int:
    """Threads for the next step: the `cores` that the machine's `running` tasks, less this process's
    `own_running` threads, leave free; between 1 and `max_threads`."""
    return max(1, min(max_threads, cores - max(0, running - own_running)))


class RunnableTasks:
    """Reads how many tasks are runnable: the machine's, and this process's own. The procfs files stay open
    (closed with this object), so a sample costs a few reads, not opens."""

    def __init__(self) -> None:
        self._loadavg = open(LOADAVG, "rb", buffering=0)
        self._tasks: dict[str, BinaryIO] = {}
        self._listed = -float("inf")

    def machine(self) -> int:
        """Runnable tasks of the whole machine, this thread included."""
        line = os.pread(self._loadavg.fileno(), 128, 0)
        return int(line.split()[3].split(b"/")[0])

    def own(self) -> int:
        """This process's threads that are running or waiting for a core (state R)."""
        if time.monotonic() - self._listed > TASK_REFRESH_S:
            self._relist()
        running = 0
        for tid, stat in list(self._tasks.items()):
            try:
                line = os.pread(stat.fileno(), 512, 0)
            except OSError:  # the thread has exited
                self._tasks.pop(tid).close()
                continue
            end = line.rfind(b")")  # the command name may hold spaces and parentheses
            if line[end + 2:end + 3] == b"R":
                running += 1
        return running

    def _relist(self) -> None:
        alive = set(os.listdir(TASK_DIR))
        for tid in set(self._tasks) - alive:
            self._tasks.pop(tid).close()
        for tid in alive - set(self._tasks):
            try:
                self._tasks[tid] = open(f"{TASK_DIR}/{tid}/stat", "rb", buffering=0)
            except OSError:  # exited meanwhile
                pass
        self._listed = time.monotonic()


class ThreadGovernor:
    """Sets the calling thread's torch thread count before each step (`adjust`) and puts it back after
    (`restore`). Steps run on the thread that built the engine, whose count this is."""

    def __init__(self, cores: int, max_threads: int | None = None,
                 sample: Callable[[], tuple[int, int]] | None = None) -> None:
        """`cores`: the CPUs this process may use; `max_threads`: the most a step gets (default: the
        calling thread's torch thread count now); `sample`: returns (machine's runnable tasks, this
        process's), by default read from procfs."""
        self.cores = cores
        self.max_threads = max_threads or torch.get_num_threads()
        self._reader = None if sample is not None else RunnableTasks()
        self._sample = sample or self._read
        self._current = self.max_threads
        self.reduced_steps = 0
        """Steps that ran on fewer than `max_threads` threads."""

    def _read(self) -> tuple[int, int]:
        running = self._reader.machine()
        # Alone, only the reading thread runs: nothing to tell apart.
        return running, (1 if running <= 1 else self._reader.own())

    def adjust(self) -> int:
        """Set the thread count for the step about to run; returns it."""
        running, own = self._sample()
        threads = step_threads(self.max_threads, self.cores, running, own)
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads
        if threads < self.max_threads:
            self.reduced_steps += 1
        return threads

    def restore(self) -> None:
        """Give the calling thread back `max_threads` (after a step, so nothing else runs on fewer)."""
        if self._current != self.max_threads:
            torch.set_num_threads(self.max_threads)
            self._current = self.max_threads
