"""The gRPC server: fastgen's typed service, MII's `modelresponse` service (`mii_service`), health and
reflection.

A thread-pool server over one backend (a local engine loop or the replica router): every RPC
runs in its own worker thread and submits its prompts to the backend, whose engine batches them
with everyone else's. When a call ends early (client cancelled, disconnected or past its
deadline) gRPC runs the call's callback, which aborts its requests; the engine frees their KV
blocks at its next step.

What a call passes first (`ServingLimits`): the API key (every method of both services when keys
are set; health and reflection stay open), the message size, the prompts and `n` per request and
the sequences in flight; the statuses a call ends with are `status`'s. The typed service also
loads, unloads and lists LoRA adapters (on every replica, behind the replica router), under the
same key as generation.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fastgen.engine import RequestGroup, TensorParallelError, submit_group
from fastgen.sampling_params import SamplingParams
from fastgen.serving.backend import Backend, BackendUnavailable
from fastgen.serving.grpc.convert import (completion_from_response, model_info_to_proto, params_from_proto,
                                          prompts_from_proto)
from fastgen.serving.admission import PendingBudget, shared_budget
from fastgen.serving.grpc.guard import ApiKeyInterceptor, server_credentials
from fastgen.serving.grpc.mii_service import ModelResponseServicer
from fastgen.serving.grpc.status import ERROR_FIELD_KEY, ERROR_TYPE_KEY, fail, reject, rejection
from fastgen.serving.limits import ServingLimits
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc
from fastgen.serving.grpc.proto import modelresponse_pb2 as mii_pb
from fastgen.serving.grpc.proto import modelresponse_pb2_grpc as mii_grpc

logger = logging.getLogger("fastgen.serving")

# The status helpers are `status`'s; clients and tests have long imported them from here.
__all__ = ["CHANNEL_OPTIONS", "ERROR_FIELD_KEY", "ERROR_TYPE_KEY", "MAX_MESSAGE_BYTES", "MII_SERVICE",
           "REQUEST_IDS_KEY", "TYPED_SERVICE", "FastGenServicer", "GrpcServer", "rejection"]

REQUEST_IDS_KEY = "fastgen-request-ids"
"""Initial-metadata key a GenerateStream sends once all its prompts are accepted."""
TYPED_SERVICE = pb.DESCRIPTOR.services_by_name["FastGen"].full_name
"""Full name of fastgen's typed service (also its health-service name)."""
MII_SERVICE = mii_pb.DESCRIPTOR.services_by_name["ModelResponse"].full_name
"""Full name of MII's service (also its health-service name)."""
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""Largest message either side accepts (gRPC's default of 4 MiB is too small for long token-id prompts)."""
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
"""Channel options shared by the server and our clients (long prompts as token ids are large)."""


class FastGenServicer(pb_grpc.FastGenServicer):
    """fastgen.v1.FastGen over a backend."""

    def __init__(self, server: "GrpcServer") -> None:
        self._server = server

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        """Every completion of every prompt, once all are finished."""
        try:
            group, done = self._server.admit(prompts_from_proto(request.prompts), params_from_proto(request.params),
                                             context, lora=request.lora or None)
        except Exception as exc:
            reject(self._server, context, exc)
        try:
            return pb.GenerateResponse(completions=[completion_from_response(r) for r in group.results()])
        except Exception as exc:
            fail(self._server, context, exc)
        finally:
            done()

    def GenerateStream(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.Completion]:
        """Each completion's deltas as they are produced, interleaved across prompts and choices."""
        try:
            group, done = self._server.admit(prompts_from_proto(request.prompts), params_from_proto(request.params),
                                             context, lora=request.lora or None)
        except Exception as exc:
            reject(self._server, context, exc)
        try:
            context.send_initial_metadata(((REQUEST_IDS_KEY, ",".join(group.request_ids)),))
            for delta in group:
                yield completion_from_response(delta)
        except Exception as exc:
            fail(self._server, context, exc)
        finally:
            done()

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        """Token ids of each text, as the engine encodes a text prompt."""
        try:
            tokenizer = self._server.backend().tokenizer
            special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = [tokenizer.encode(text, add_special_tokens=special) for text in request.texts]
        except Exception as exc:
            reject(self._server, context, exc)
        return pb.TokenizeResponse(token_ids=[pb.TokenIds(ids=i) for i in ids])

    def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.ServicerContext) -> pb.ModelInfoResponse:
        """The served model and engine configuration (and replicas, behind a load balancer)."""
        try:
            info = self._server.backend().model_info()
        except Exception as exc:
            fail(self._server, context, exc)
        return model_info_to_proto(dataclasses.replace(info, deployment_name=self._server.deployment_name))

    def Terminate(self, request: pb.TerminateRequest, context: grpc.ServicerContext) -> pb.TerminateResponse:
        """Stop the deployment."""
        self._server.request_termination()
        return pb.TerminateResponse()

    def ListLoRA(self, request: pb.ListLoRARequest, context: grpc.ServicerContext) -> pb.ListLoRAResponse:
        """The adapters loaded and those that requests use now."""
        try:
            adapters = self._server.backend().adapters
            paths, usage = adapters.paths(), adapters.usage()
        except Exception as exc:
            fail(self._server, context, exc)
        return pb.ListLoRAResponse(adapters=paths, running=usage.get("lora_running", ()),
                                   waiting=usage.get("lora_waiting", ()), max_loras=usage.get("lora_max_loras", 0))

    def LoadLoRA(self, request: pb.LoadLoRARequest, context: grpc.ServicerContext) -> pb.LoadLoRAResponse:
        """Load an adapter: INVALID_ARGUMENT naming the problem (nothing loaded)."""
        try:
            self._server.backend().adapters.load(request.name, request.path)
        except Exception as exc:
            reject(self._server, context, exc)
        logger.info("LoRA adapter %r loaded from %s", request.name, request.path)
        return pb.LoadLoRAResponse()

    def UnloadLoRA(self, request: pb.UnloadLoRARequest, context: grpc.ServicerContext) -> pb.UnloadLoRAResponse:
        """Unload an adapter: NOT_FOUND when not loaded, FAILED_PRECONDITION while requests use it."""
        try:
            self._server.backend().adapters.unload(request.name)
        except Exception as exc:
            reject(self._server, context, exc)
        logger.info("LoRA adapter %r unloaded", request.name)
        return pb.UnloadLoRAResponse()


class GrpcServer:
    """Both services, health and reflection on one port, over a backend that may arrive later.

    Until `set_backend` the health service says NOT_SERVING and generation calls are UNAVAILABLE
    (the model is loading). `Terminate` sets `terminated` and calls `on_terminate` if given
    (the launcher then shuts the whole deployment down), else stops this server. `limits` sets
    the API keys and bounds (default: no key, `ServingLimits()`'s bounds); `tls_cert`/`tls_key`
    (PEM files, both or neither) serve TLS instead of plain TCP. `budget` is the deployment's
    admission budget when the REST gateway shares it (default: this server's own, of
    `limits.max_pending_requests`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, deployment_name: str = "",
                 backend: Backend | None = None, max_workers: int = 128,
                 on_terminate: Callable[[], None] | None = None, limits: ServingLimits | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 budget: PendingBudget | None = None) -> None:
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
        if limits is not None and not isinstance(limits, ServingLimits):
            raise TypeError(f"limits must be a ServingLimits or None, got {type(limits).__name__}")
        self.host = host
        self.port = port
        self.deployment_name = deployment_name
        self.limits = limits if limits is not None else ServingLimits()
        self.terminated = threading.Event()
        self._on_terminate = on_terminate
        self._backend: Backend | None = None
        self.budget = shared_budget(budget, self.limits.max_pending_requests)
        """The sequences in flight, bounded by `limits.max_pending_requests` (shared with the REST gateway)."""
        self._credentials = server_credentials(tls_cert, tls_key)
        self._stopping = False
        self._health = health.HealthServicer()
        keys = self.limits.api_keys
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers, thread_name_prefix="fastgen-grpc"),
            interceptors=[ApiKeyInterceptor(keys)] if keys else None,
            # A message over the body limit is refused by gRPC itself (RESOURCE_EXHAUSTED) before it is parsed.
            options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_receive_message_length", self.limits.max_body_bytes), ("grpc.so_reuseport", 0)])
        pb_grpc.add_FastGenServicer_to_server(FastGenServicer(self), self._server)
        mii_grpc.add_ModelResponseServicer_to_server(ModelResponseServicer(self), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (TYPED_SERVICE, MII_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        for service in ("", TYPED_SERVICE, MII_SERVICE):
            self.set_health(service, False)
        self._started = False
        if backend is not None:
            self.set_backend(backend)

    @property
    def address(self) -> str:
        """host:port as bound (the real port once started)."""
        return f"{self.host}:{self.port}"

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS."""
        return self._credentials is not None

    @property
    def pending(self) -> int:
        """Sequences (prompts x n) admitted and not yet finished."""
        return self.budget.pending

    def start(self) -> int:
        """Bind and start serving; returns the port. Raises OSError if the port is taken."""
        target = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        try:
            if self._credentials is not None:
                port = self._server.add_secure_port(target, self._credentials)
            else:
                port = self._server.add_insecure_port(target)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port}: the port is already in use "
                          f"(or the address is not available on this machine)")
        self.port = port
        self._server.start()
        self._started = True
        return port

    def set_backend(self, backend: Backend) -> None:
        """Serve from `backend` from now on; health turns SERVING."""
        self._backend = backend
        for service in ("", TYPED_SERVICE, MII_SERVICE):
            self.set_health(service, True)

    def backend(self) -> Backend:
        """The backend, or BackendUnavailable while none is set."""
        backend = self._backend
        if backend is None:
            raise BackendUnavailable("the deployment is still loading its model; retry when health says SERVING")
        return backend

    def admit(self, prompts: list, params: SamplingParams, context: grpc.ServicerContext,
              field: str = "prompts", lora: str | None = None) -> tuple[RequestGroup, Callable[[], None]]:
        """Check a call's request against the limits, take its sequences from the pending budget and
        submit its prompts, under the LoRA adapter `lora` (None: the base model). Returns the group and
        its release, which the servicer calls when the group ends; the call's end (normal, failed or
        cancelled) also aborts what is left and releases, so a client that goes away gives its place back."""
        self.limits.check_request_size(len(prompts), params.n, field)
        backend = self.backend()
        release = self.budget.acquire(len(prompts) * params.n, "n" if params.n > 1 else field)
        try:
            group = submit_group(backend, prompts, params, field, lora)
        except BaseException:
            release()
            raise

        def end() -> None:
            group.abort()
            release()

        if not context.add_callback(end):
            end()  # the call had already ended
        return group, release

    def engine_stopped(self, exc: BaseException | None = None) -> bool:
        """Whether the server or its engine has stopped for good (`exc`: the error a request got),
        so a failure means "not serving" rather than "this request failed"."""
        if self._stopping or isinstance(exc, TensorParallelError):
            return True
        loop = getattr(self._backend, "loop", None)
        return loop is not None and (loop.stopped or loop.fatal_error is not None)

    def set_health(self, service: str, serving: bool) -> None:
        """Report `service` ("" = the whole server) as SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self._health.set(service, status)

    def drain(self) -> None:
        """Stop admitting (new calls get UNAVAILABLE, and so do REST's when it shares the budget) and
        report NOT_SERVING, while the calls already admitted run on; `budget.wait_idle` says when they
        have all ended."""
        self.budget.drain()
        for service in ("", TYPED_SERVICE, MII_SERVICE):
            self.set_health(service, False)

    def request_termination(self) -> None:
        """What `Terminate` does: flag it, then shut down (through `on_terminate` when given)."""
        logger.info("terminate requested")
        self.terminated.set()
        if self._on_terminate is not None:
            self._on_terminate()
        else:
            threading.Thread(target=self.stop, name="fastgen-grpc-stop", daemon=True).start()

    def stop(self, grace: float = 2.0) -> None:
        """Stop accepting calls, give running ones `grace` seconds, then cancel them (aborting their requests)."""
        self._stopping = True
        self._health.enter_graceful_shutdown()
        if self._started:
            self._server.stop(grace).wait()

    def __enter__(self) -> "GrpcServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop(grace=0)
