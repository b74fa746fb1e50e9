"""The LoRA adapters behind the replica router: every replica holds the same ones.

`ReplicaAdapters` is the router's `ServedAdapters`. It keeps the deployment's adapters (name ->
directory; at start-up a replica's, since all loaded the same `--lora-modules`) and how many of the
router's requests in flight use each, and drives the replicas' LoadLoRA, UnloadLoRA and ListLoRA:

- A request naming an adapter counts as using it until it ends; a name not served is refused
  (`UnknownLoRAError`) before any replica sees it.
- A load goes to every healthy replica in turn. When one refuses (a bad adapter: ValueError naming
  the problem) or fails, those that loaded it unload it again: nothing is left half-loaded.
- An unload is refused (`LoRAStateError`) while the router's requests use the adapter, which is
  checked before any replica is asked, so replicas are never left split; the name stops being served
  at that moment, and a replica still dropping a request aborted just before is given a moment.
- The router restarts no replica. One it cannot reach is taken out of rotation, and one whose adapters
  may differ (a load or its undo failed there) is marked `OUT_OF_SYNC`; when such a replica's health
  says SERVING again it is first given the adapters loaded and unloaded meanwhile (`restore`), and
  stays out of rotation, saying why, while that fails.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastgen.engine import UnknownLoRAError
from fastgen.serving.backend import NO_LORA, BackendUnavailable, LoRAStateError, ServedAdapters
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb

if TYPE_CHECKING:
    from fastgen.serving.deploy.replicas import Replica, ReplicaRouter

logger = logging.getLogger("fastgen.serving")

LOAD_TIMEOUT_S = 300.0
"""Seconds one replica may take to read and check an adapter (large adapters on slow disks)."""
CALL_TIMEOUT_S = 10.0
"""Seconds for the other adapter calls of a replica."""
SCRAPE_TIMEOUT_S = 2.0
"""Seconds a /metrics scrape waits for one replica's adapter use (a stuck replica must not stall it)."""
SETTLE_S = 5.0
"""Seconds an unload waits for a replica to drop requests aborted just before (its engine frees
them at its next step, after the router has already counted them finished)."""
OUT_OF_SYNC = "NOT_SERVING: its LoRA adapters may differ from the deployment's"
"""The status of a replica whose adapters could not be kept in line (`restore` repairs it)."""


class ReplicaAdapters(ServedAdapters):
    """The adapters every replica of `router` serves, loaded and unloaded on all of them or none."""

    def __init__(self, router: ReplicaRouter) -> None:
        """The adapters the first replica that answers holds (all started with the same ones)."""
        self._router = router
        self._admin = threading.Lock()  # one load, unload or restore at a time
        self._lock = threading.Lock()  # the names and their users, which every submission reads
        self._users: collections.Counter[str] = collections.Counter()
        for replica in router.replicas:
            try:
                listing = router.call(replica, "ListLoRA", pb.ListLoRARequest(), CALL_TIMEOUT_S)
                break
            except BackendUnavailable:
                continue
        else:
            raise BackendUnavailable("no replica answered: cannot tell which LoRA adapters they serve")
        self.max_loras = listing.max_loras
        """Distinct adapters one step of a replica may use; 0: the deployment serves none."""
        self._paths = dict(listing.adapters)

    def paths(self) -> dict[str, str]:
        """The adapters served: name -> directory."""
        with self._lock:
            return dict(self._paths)

    def hold(self, name: str | None) -> None:
        """Count a request under adapter `name` (None: the base model) as using it until `drop`;
        `UnknownLoRAError` for a name not served."""
        if name is None:
            return
        with self._lock:
            if name not in self._paths:
                if not self.max_loras:
                    raise ValueError(f"LoRA adapter {name!r} requested but {NO_LORA}")
                raise self._unknown(name)
            self._users[name] += 1

    def _unknown(self, name: str) -> UnknownLoRAError:
        """The error for adapter `name`, not served (the engine's words; called holding `_lock`)."""
        return UnknownLoRAError(f"unknown LoRA adapter {name!r} (loaded: "
                                f"{', '.join(map(repr, sorted(self._paths))) or 'none'})")

    def drop(self, name: str | None) -> None:
        """A request under adapter `name` (held) ended."""
        if name is None:
            return
        with self._lock:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]

    def load(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` on every healthy replica, or on none: ValueError
        naming the problem when one refuses it, BackendUnavailable when no replica could take it."""
        if not self.max_loras:
            raise ValueError(NO_LORA)
        with self._admin:
            with self._lock:
                if name in self._paths:
                    raise ValueError(f"a LoRA adapter named {name!r} is already loaded (from {self._paths[name]}); "
                                     "unload it first")
            loaded: list[Replica] = []
            for replica in self._router.serving():
                try:
                    self._router.call(replica, "LoadLoRA", pb.LoadLoRARequest(name=name, path=path), LOAD_TIMEOUT_S)
                except BackendUnavailable:
                    continue  # out of rotation now; `restore` gives it the adapter when it is back
                except ValueError:
                    self._undo(loaded, "UnloadLoRA", pb.UnloadLoRARequest(name=name))
                    raise
                except Exception:
                    # Its state is unknown (it may load it yet): it rejoins only through `restore`.
                    self._router.mark_down(replica, OUT_OF_SYNC)
                    self._undo(loaded, "UnloadLoRA", pb.UnloadLoRARequest(name=name))
                    raise
                loaded.append(replica)
            if not loaded:
                raise BackendUnavailable("no healthy replica is left to load the adapter on")
            with self._lock:
                self._paths[name] = path
        logger.info("LoRA adapter %r loaded from %s on %d replica(s)", name, path, len(loaded))

    def unload(self, name: str) -> None:
        """Unload adapter `name` from every replica: `UnknownLoRAError` when it is not served,
        `LoRAStateError` (nothing unloaded) while requests use it."""
        if not self.max_loras:
            raise ValueError(NO_LORA)
        with self._admin:
            with self._lock:
                if name not in self._paths:
                    raise self._unknown(name)
                if self._users[name]:
                    raise LoRAStateError(f"LoRA adapter {name!r} is in use by {self._users[name]} unfinished "
                                         "request(s): unload it once they end")
                path = self._paths.pop(name)  # from here on no request can start under it
            unloaded: list[Replica] = []
            try:
                for replica in self._router.serving():
                    if self._unload_from(replica, name):
                        unloaded.append(replica)
            except BaseException:
                self._undo(unloaded, "LoadLoRA", pb.LoadLoRARequest(name=name, path=path))
                with self._lock:
                    self._paths[name] = path
                raise
        logger.info("LoRA adapter %r unloaded from %d replica(s)", name, len(unloaded))

    def _unload_from(self, replica: Replica, name: str) -> bool:
        """Unload `name` from `replica`; whether it held it (False too when it is out of reach)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                self._router.call(replica, "UnloadLoRA", pb.UnloadLoRARequest(name=name), CALL_TIMEOUT_S)
                return True
            except (UnknownLoRAError, BackendUnavailable):
                return False
            except LoRAStateError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _undo(self, replicas: list[Replica], method: str, request: Any) -> None:
        """Put `replicas` back as they were (`method(request)`); one that fails is marked `OUT_OF_SYNC`."""
        for replica in replicas:
            try:
                self._router.call(replica, method, request, LOAD_TIMEOUT_S)
            except Exception as exc:
                logger.error("replica %d: cannot undo a LoRA change (%s: %s)", replica.index, method, exc)
                self._router.mark_down(replica, OUT_OF_SYNC)

    def restore(self, replica: Replica, set_status: Callable[[str], None]) -> None:
        """Give `replica`, healthy again after time out of rotation, the adapters served now (unloading
        the others), then `set_status` SERVING, or NOT_SERVING saying why; nothing while a load or
        unload runs (the next health check tries again)."""
        if not self._admin.acquire(blocking=False):
            return
        try:
            try:
                self._sync(replica)
                status = "SERVING"
            except Exception as exc:
                status = f"NOT_SERVING: cannot restore its LoRA adapters ({exc})"
            set_status(status)
        finally:
            self._admin.release()

    def _sync(self, replica: Replica) -> None:
        if not self.max_loras:
            return
        have = dict(self._router.call(replica, "ListLoRA", pb.ListLoRARequest(), CALL_TIMEOUT_S).adapters)
        want = self.paths()
        for name, path in have.items():
            if want.get(name) != path:
                self._router.call(replica, "UnloadLoRA", pb.UnloadLoRARequest(name=name), CALL_TIMEOUT_S)
        for name, path in want.items():
            if have.get(name) != path:
                self._router.call(replica, "LoadLoRA", pb.LoadLoRARequest(name=name, path=path), LOAD_TIMEOUT_S)
        if have != want:
            logger.info("replica %d: LoRA adapters restored (%s)", replica.index, ", ".join(sorted(want)) or "none")

    def usage(self) -> dict[str, Any]:
        """The adapters that running and waiting requests use over every live replica (one out of
        rotation may still be finishing requests), and each replica's `max_loras` (they are started
        alike); empty without LoRA."""
        if not self.max_loras:
            return {}
        running: set[str] = set()
        waiting: set[str] = set()
        for replica in [r for r in self._router.replicas if not r.status.startswith("DEAD")]:
            try:
                listing = self._router.call(replica, "ListLoRA", pb.ListLoRARequest(), SCRAPE_TIMEOUT_S)
            except Exception:
                continue  # the replica's own trouble is the health check's to report, not a scrape's
            running.update(listing.running)
            waiting.update(listing.waiting)
        return {"lora_running": sorted(running), "lora_waiting": sorted(waiting), "lora_max_loras": self.max_loras}
