"""How many CPU threads a step runs on when other processes want the same cores.

A CPU step is ~1,000 parallel regions, each ending at a barrier that every OpenMP thread must reach. When a
thread of the team has lost its core to another runnable process, the others wait at the barrier until the
scheduler gives it back, one time slice later; a step whose team fills every core then runs several times
slower than on one thread fewer. Measured on a 2-core EPYC (SmolLM2-135M bf16, a burst of 16 prompts of 286
tokens, one busy process beside the engine): 8.8-11.7 s at 2 threads against 5.0-5.3 s at 1 (2.4 s at 2 alone).
A load generator, a co-located API process or a build is such a process.

`ThreadGovernor` decides before each step how many cores other processes kept busy lately (`OtherLoad`: the
machine's busy CPU time in `/proc/stat` less this process's own, over the last 0.1 s or more), and gives the
step the cores they leave free: at least one, at most the thread count the process started with. The count
holds for the step only: `restore()` gives the caller back its threads. This process's own threads (a server
thread, tokenizers) are never counted against it.

It is a plan option that is off unless asked for (`adaptive_threads`): beside a load generator that shares
the cores (guidellm's client) it gave up more than it won; see the plan's reason for the figures.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable

import torch

STAT = "/proc/stat"
"""Linux's CPU accounting; its first line is the machine's CPU time by state, in clock ticks."""

WINDOW_S = 0.1
"""Seconds of history, at least, behind each estimate of the other processes' load: long enough to hold
several clock ticks per core, short enough to follow a burst."""


def adaptive_threads_supported() -> bool:
    """Whether this OS shows the machine's CPU time (Linux's /proc/stat)."""
    return sys.platform.startswith("linux") and os.path.exists(STAT)


def step_threads(max_threads: int, cores: int, other_cores: float) -> int:
    """Threads for the next step: the `cores` left free by other processes that kept `other_cores` cores busy
    lately (CPU seconds per second, rounded), between 1 and `max_threads`."""
    return max(1, min(max_threads, cores - int(other_cores + 0.5)))


class OtherLoad:
    """Cores that other processes kept busy over the last `WINDOW_S` or more: the machine's busy CPU time
    (`/proc/stat`, stolen time left out) less this process's (`time.process_time`), over wall time. Each call
    is one sample; the window runs from the newest sample at least `WINDOW_S` old (the first call: 0), so after
    an idle spell it is the load since the last step."""

    def __init__(self) -> None:
        self._stat = open(STAT, "rb", buffering=0)  # closed with this object
        self._tick = os.sysconf("SC_CLK_TCK")
        self._samples: collections.deque[tuple[float, float, float]] = collections.deque()

    def _busy_seconds(self) -> float:
        # user nice system idle iowait irq softirq (steal ...): the busy states, stolen time left out
        user, nice, system, _, _, irq, softirq = map(int, os.pread(self._stat.fileno(), 256, 0).split()[1:8])
        return (user + nice + system + irq + softirq) / self._tick

    def __call__(self) -> float:
        now, busy, own = time.monotonic(), self._busy_seconds(), time.process_time()
        samples = self._samples
        samples.append((now, busy, own))
        while len(samples) > 2 and now - samples[1][0] >= WINDOW_S:
            samples.popleft()
        then, busy_then, own_then = samples[0]
        if now <= then:
            return 0.0
        return max(0.0, (busy - busy_then - (own - own_then)) / (now - then))


class ThreadGovernor:
    """Sets the calling thread's torch thread count before each step (`adjust`) and puts it back after
    (`restore`). Steps run on the thread that built the engine, whose count this is."""

    def __init__(self, cores: int, max_threads: int | None = None, sample: Callable[[], float] | None = None) -> None:
        """`cores`: the CPUs this process may use; `max_threads`: the most a step gets (default: the
        calling thread's torch thread count now); `sample`: the cores other processes keep busy (default:
        `OtherLoad`)."""
        self.cores = cores
        self.max_threads = max_threads or torch.get_num_threads()
        self._sample = sample or OtherLoad()
        self._sample()  # so that the first step's estimate covers the time since start-up
        self._current = self.max_threads
        self.reduced_steps = 0
        """Steps that ran on fewer than `max_threads` threads."""

    def adjust(self) -> int:
        """Set the thread count for the step about to run; returns it."""
        threads = step_threads(self.max_threads, self.cores, self._sample())
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
