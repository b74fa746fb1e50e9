"""`replica_num=N`: N engine processes, each a gRPC server, behind one load-balancing front end.

The front end runs the same services over a `ReplicaRouter`, which has the backend interface of
a local engine loop: each request goes to the healthy replica with the fewest requests in flight
(ties in turn). A monitor thread checks every replica's process and health service; a replica
that dies or stops serving is logged, reported through the front end's health service
(`fastgen.replica.<i>`) and `ModelInfo`, and routed around. Replica processes watch the front
end's pid and exit if it dies, and the front end stops them all on shutdown. Replicas listen on
127.0.0.1 only (plain TCP: the hop never leaves the machine) and require the front end's API
keys, which the router presents on every call. The replicas serve the same LoRA adapters, which
requests may name and which load and unload on all of them together (`replica_lora`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastgen.api import normalise_prompts
from fastgen.engine import Deliveries, Sink
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams
from fastgen.serving.backend import BackendUnavailable, ModelInfo, ReplicaInfo
from fastgen.serving.grpc.convert import (model_info_from_proto, params_to_proto, prompts_to_proto,
                                          response_from_completion)
from fastgen.serving.grpc.guard import auth_metadata
from fastgen.serving.grpc.server import CHANNEL_OPTIONS, MII_SERVICE, REQUEST_IDS_KEY, TYPED_SERVICE, rejection
from fastgen.serving.limits import API_KEY_ENV
from fastgen.serving.deploy.processes import read_json, stop_process
from fastgen.serving.deploy.replica_lora import ReplicaAdapters
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc

logger = logging.getLogger("fastgen.serving")

_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclasses.dataclass(eq=False)
class Replica:
    """One engine server the router sends requests to."""

    index: int
    """Position in the deployment (also in its health service name `fastgen.replica.<index>`)."""
    address: str
    """host:port of the replica's gRPC server."""
    process: subprocess.Popen | None = None
    """The replica's process when this front end started it."""
    in_flight: int = 0
    """Requests sent to it and not yet finished."""
    num_requests: int = 0
    """Requests sent to it in total."""
    status: str = "SERVING"
    """"SERVING", "NOT_SERVING", "UNREACHABLE" or "DEAD: <why>"."""
    api_key: str | None = dataclasses.field(default=None, repr=False)
    """The key the replica requires (None: it is open)."""

    def __post_init__(self) -> None:
        self.metadata = auth_metadata(self.api_key)  # sent on every call but health, which is open
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.FastGenStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def healthy(self) -> bool:
        """Whether new requests may go here."""
        return self.status == "SERVING"

    @property
    def pid(self) -> int:
        """The replica's pid, or -1 when it is not our child."""
        return self.process.pid if self.process is not None else -1


def _replica_error(call: grpc.Call) -> Exception:
    """The exception a replica's rejection stands for (INVALID_ARGUMENT keeps its Python type, NOT_FOUND
    is `UnknownLoRAError`, FAILED_PRECONDITION `LoRAStateError`)."""
    rejected = rejection(call)
    if rejected is not None:
        return rejected
    return RuntimeError(f"replica call failed ({call.code().name}): {call.details()}")


class RemoteStream:
    """The deltas of one request running on a replica; `abort()` cancels the replica's call."""

    def __init__(self, router: "ReplicaRouter", replica: Replica, call: Any, request_id: str,
                 with_logprobs: bool, lora: str | None) -> None:
        self.request_id = request_id
        self.lora = lora
        """The LoRA adapter the request runs under (None: the base model)."""
        self._router = router
        self._replica = replica
        self._call = call
        self._with_logprobs = with_logprobs
        self._aborted = False

    def __iter__(self) -> Iterator[Response]:
        try:
            for msg in self._call:
                delta = response_from_completion(msg, self._with_logprobs)
                delta.request_id = self.request_id
                yield delta
        except grpc.RpcError as exc:
            if self._aborted and exc.code() == grpc.StatusCode.CANCELLED:
                return
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self._router.mark_down(self._replica, "UNREACHABLE")
                raise BackendUnavailable(f"replica {self._replica.index} went away during the request: "
                                         f"{exc.details()}") from None
            raise _replica_error(exc) from None
        finally:
            self._router.release(self._replica, self.request_id)

    def abort(self) -> None:
        """Cancel the request; the replica aborts it and frees its KV blocks."""
        self._aborted = True
        self._call.cancel()


class ReplicaRouter:
    """Backend over replicas: least-loaded routing, health monitoring, routing around failures."""

    def __init__(self, replicas: list[Replica], tokenizer: Any, *, report: Callable[[str, bool], None] | None = None,
                 on_all_down: Callable[[], None] | None = None, check_interval: float = 0.5) -> None:
        if not replicas:
            raise ValueError("a replica router needs at least one replica")
        self.replicas = replicas
        self.tokenizer = tokenizer
        self._report = report or (lambda service, serving: None)
        self._on_all_down = on_all_down
        self._lock = threading.Lock()
        self._streams: dict[str, RemoteStream] = {}
        self._deliveries = Deliveries()
        self._next = 0
        self._closed = threading.Event()
        self._interval = check_interval
        for replica in replicas:
            self._report(f"fastgen.replica.{replica.index}", replica.healthy)
        self.adapters = ReplicaAdapters(self)
        self._monitor = threading.Thread(target=self._watch, name="fastgen-replica-monitor", daemon=True)
        self._monitor.start()

    # Routing ---------------------------------------------------------------------------------

    def _pick(self, exclude: set[int]) -> Replica:
        with self._lock:
            candidates = [r for r in self.replicas if r.healthy and r.index not in exclude]
            if not candidates:
                raise BackendUnavailable("no healthy replica is left to take the request")
            n = len(self.replicas)
            replica = min(candidates, key=lambda r: (r.in_flight, (r.index - self._next) % n))
            self._next = (replica.index + 1) % n
            replica.in_flight += 1
            replica.num_requests += 1
            return replica

    def serving(self) -> list[Replica]:
        """The replicas in rotation now."""
        with self._lock:
            return [r for r in self.replicas if r.healthy]

    def release(self, replica: Replica, request_id: str | None) -> None:
        """A request on `replica` ended (finished, failed or aborted)."""
        with self._lock:
            replica.in_flight -= 1
            stream = self._streams.pop(request_id, None) if request_id is not None else None
        if stream is not None:
            self.adapters.drop(stream.lora)

    def call(self, replica: Replica, method: str, request: Any, timeout: float) -> Any:
        """`method(request)` of `replica`'s typed service: a replica out of reach is taken out of
        rotation (BackendUnavailable), a refusal raised as its exception (`_replica_error`)."""
        try:
            return getattr(replica.stub, method)(request, timeout=timeout, metadata=replica.metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.mark_down(replica, "UNREACHABLE")
                raise BackendUnavailable(f"replica {replica.index} cannot be reached: {exc.details()}") from None
            raise _replica_error(exc) from None

    def submit(self, prompt: Any, params: SamplingParams | None, deliver: Sink,
               lora: str | None = None) -> RemoteStream:
        """Send a request to the least-loaded healthy replica, under the LoRA adapter `lora` (None: the
        base model; every replica holds the same adapters), whose deltas a thread reads into `deliver`
        (a `RequestGroup` sink); raises its ValueError/TypeError if rejected, `UnknownLoRAError` for an
        adapter not served."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        # Deltas carry generated text only, as the local engine loop's do; the services add the prompt.
        request = pb.GenerateRequest(prompts=prompts_to_proto(normalise_prompts([prompt])),
                                     params=params_to_proto(dataclasses.replace(params, return_full_text=False)),
                                     lora=lora or "")
        self.adapters.hold(lora)  # in use until the request ends (`release`), so no unload breaks it
        try:
            return self._send(request, deliver, lora, params.logprobs is not None)
        except BaseException:
            self.adapters.drop(lora)
            raise

    def _send(self, request: pb.GenerateRequest, deliver: Sink, lora: str | None, with_logprobs: bool) -> RemoteStream:
        """Start `request` on the least-loaded healthy replica, trying the next while one is out of reach."""
        tried: set[int] = set()
        while True:
            replica = self._pick(tried)
            call = replica.stub.GenerateStream(request, metadata=replica.metadata)
            metadata = dict(call.initial_metadata() or ())
            if REQUEST_IDS_KEY in metadata:
                request_id = f"r{replica.index}-{metadata[REQUEST_IDS_KEY]}"
                stream = RemoteStream(self, replica, call, request_id, with_logprobs, lora)
                with self._lock:
                    self._streams[request_id] = stream
                # Ended by `_pump` when the call ends (the replica released), not by its last delta.
                self._deliveries.open(request_id, deliver, None)
                threading.Thread(target=self._pump, args=(stream,), daemon=True, name="fastgen-replica-pump").start()
                return stream
            self.release(replica, None)
            if call.code() == grpc.StatusCode.UNAVAILABLE:
                self.mark_down(replica, "UNREACHABLE")
                tried.add(replica.index)
                continue
            raise _replica_error(call)

    def _pump(self, stream: RemoteStream) -> None:
        """Deliver a replica request's deltas (a thread per request: a gRPC stream's reads block);
        the stream's end, or its error, ends the request."""
        try:
            for delta in stream:
                self._deliveries.deliver(delta)
        except Exception as exc:
            self._deliveries.close(stream.request_id, exc)
        self._deliveries.close(stream.request_id)

    async def submit_async(self, prompt: Any, params: SamplingParams | None, deliver: Sink,
                           lora: str | None = None) -> RemoteStream:
        """`submit` for asyncio code, delivering to `deliver` (an asynchronous `RequestGroup`'s sink).

        The replica's gRPC round trip runs on a worker thread, so the event loop never waits on it.
        """
        return await asyncio.to_thread(self.submit, prompt, params, deliver, lora)

    def abort(self, request_id: str) -> None:
        """Cancel a request by id; unknown or finished ids are ignored."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    def model_info(self) -> ModelInfo:
        """A healthy replica's model summary, with every replica's state."""
        for replica in self.serving():
            try:
                info = model_info_from_proto(
                    replica.stub.ModelInfo(pb.ModelInfoRequest(), timeout=5, metadata=replica.metadata))
                break
            except grpc.RpcError:
                self.mark_down(replica, "UNREACHABLE")
        else:
            raise BackendUnavailable("no healthy replica is left")
        with self._lock:
            info.replicas = [ReplicaInfo(index=r.index, address=r.address, healthy=r.healthy, in_flight=r.in_flight,
                                         num_requests=r.num_requests, pid=r.pid, status=r.status)
                             for r in self.replicas]
            info.in_flight = sum(r.in_flight for r in self.replicas)
        return info

    def stats(self) -> Mapping[str, Any]:
        """The deployment's engine stats for /metrics: the LoRA adapters in use over its replicas."""
        return self.adapters.usage()

    # Health ----------------------------------------------------------------------------------

    @property
    def all_dead(self) -> bool:
        """True once every replica's process has died."""
        return all(r.status.startswith("DEAD") for r in self.replicas)

    def mark_down(self, replica: Replica, status: str) -> None:
        """Take `replica` out of rotation (a later health check may bring a live one back)."""
        self._set_status(replica, status)

    def _set_status(self, replica: Replica, status: str) -> None:
        with self._lock:
            if replica.status == status or replica.status.startswith("DEAD"):
                return
            was_any = any(r.healthy for r in self.replicas)
            previous, replica.status = replica.status, status
            any_healthy = any(r.healthy for r in self.replicas)
        if self._closed.is_set():
            return
        log = logger.info if status == "SERVING" else logger.error
        log("replica %d (%s, pid %d): %s -> %s%s", replica.index, replica.address, replica.pid, previous, status,
            "" if status == "SERVING" else "; routing around it")
        self._report(f"fastgen.replica.{replica.index}", replica.healthy)
        if any_healthy != was_any:
            for service in ("", TYPED_SERVICE, MII_SERVICE):
                self._report(service, any_healthy)
        if self.all_dead and self._on_all_down is not None:
            logger.error("every replica is dead")
            self._on_all_down()

    def _check(self, replica: Replica) -> str:
        if replica.process is not None and replica.process.poll() is not None:
            return f"DEAD: exited with code {replica.process.returncode}"
        try:
            reply = replica.health.Check(health_pb2.HealthCheckRequest(), timeout=max(self._interval, 1.0))
        except grpc.RpcError:
            return "UNREACHABLE"
        return "SERVING" if reply.status == _SERVING else "NOT_SERVING"

    def _watch(self) -> None:
        while not self._closed.wait(self._interval):
            for replica in self.replicas:
                if replica.status.startswith("DEAD"):
                    continue
                status = self._check(replica)
                if status == "SERVING" and not replica.healthy:
                    # Back in rotation only with the deployment's adapters: it may have missed loads and unloads.
                    self.adapters.restore(replica, lambda status, replica=replica: self._set_status(replica, status))
                else:
                    self._set_status(replica, status)

    def close(self) -> None:
        """Stop monitoring, then terminate every replica we started and wait for it to exit."""
        self._closed.set()
        self._monitor.join()
        for replica in self.replicas:
            if replica.process is not None and replica.process.poll() is None:
                try:
                    replica.stub.Terminate(pb.TerminateRequest(), timeout=2, metadata=replica.metadata)
                except grpc.RpcError:
                    pass
        for replica in self.replicas:
            if replica.process is not None:
                stop_process(replica.process, timeout=10)
            replica.channel.close()


def start_replicas(count: int, launcher_args: list[str], deployment_name: str, *, devices: list[str | None],
                   timeout: float, should_stop: Callable[[], bool], api_keys: tuple[str, ...] = ()) -> list[Replica]:
    """Start `count` replica servers on free loopback ports and wait until each is serving.

    Each runs `python -m fastgen.serving.deploy.launcher` with `launcher_args` (the engine options and
    bounds), its own device from `devices` when set, requires `api_keys` (none: open), and exits
    if this process dies. If one fails to start, all are stopped and RuntimeError says which and
    why (its output is in our log).
    """
    env = dict(os.environ)
    # Through the environment, not argv: a command line is readable by every user of the machine.
    env.pop(API_KEY_ENV, None)
    if api_keys:
        env[API_KEY_ENV] = ",".join(api_keys)
    if all(d is None or d == "cpu" for d in devices) and "OMP_NUM_THREADS" not in env:
        # CPU replicas would each start one thread per core and fight over them.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // count))
    ready_dir = tempfile.mkdtemp(prefix="fastgen-replicas-")
    started: list[tuple[subprocess.Popen, str]] = []
    try:
        for index in range(count):
            ready = os.path.join(ready_dir, f"replica-{index}.json")
            argv = [sys.executable, "-m", "fastgen.serving.deploy.launcher", *launcher_args,
                    "--host", "127.0.0.1", "--port", "0", "--deployment-name", f"{deployment_name}-replica-{index}",
                    "--replica-of", str(os.getpid()), "--ready-file", ready]
            if devices[index] is not None:
                argv += ["--device", devices[index]]
            started.append((subprocess.Popen(argv, env=env), ready))
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(ready) for _, ready in started):
            for index, (proc, _) in enumerate(started):
                if proc.poll() is not None:
                    raise RuntimeError(f"replica {index} exited with code {proc.returncode} while starting "
                                       "(see its log above)")
            if should_stop():
                raise RuntimeError("interrupted while the replicas were starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the replicas did not start within {timeout} s")
            time.sleep(0.1)
        replicas = []
        for index, (proc, ready) in enumerate(started):
            info = read_json(ready) or {}
            replicas.append(Replica(index=index, address=f"127.0.0.1:{info['port']}", process=proc,
                                    api_key=api_keys[0] if api_keys else None))
        return replicas
    except BaseException:
        for proc, _ in started:
            stop_process(proc, timeout=10)
        raise
    finally:
        for name in os.listdir(ready_dir):
            os.remove(os.path.join(ready_dir, name))
        os.rmdir(ready_dir)
