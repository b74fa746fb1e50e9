"""Clients of a running deployment: MII's `client.generate(...)` API over fastgen's typed service.

`Client` is blocking, `AsyncClient` has the same methods as coroutines. Generation parameters are
checked here before anything is sent (the same TypeError/ValueError a pipeline raises); what the
server rejects (a prompt too long, a token id outside the vocabulary) comes back as the same
exception type with the server's message. A missing or wrong API key is a PermissionError.

`api_key` (default: the first key of `FASTGEN_API_KEY`) is sent as `authorization: Bearer KEY`
on every call; `tls_root_cert` (a CA or self-signed certificate file) makes the connection TLS.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fastgen.api import normalise_prompts, split_mii_stream
from fastgen.engine import merge_deltas
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams
from fastgen.serving.deploy import registry
from fastgen.serving.cli import default_deployment_name
from fastgen.serving.grpc.convert import params_to_proto, prompts_to_proto, response_from_completion
from fastgen.serving.grpc.guard import auth_metadata, client_api_key, open_channel, read_pem
from fastgen.serving.grpc.server import CHANNEL_OPTIONS, rejection
from fastgen.serving.deploy.processes import connect_host, pid_alive, wait_until
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import fastgen_v1_pb2_grpc as pb_grpc

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[^:\s]+):(\d{1,5})$")


def _request(prompts: Any, gen: dict[str, Any]) -> tuple[pb.GenerateRequest, bool]:
    """Validate locally and build the request; also whether logprobs were asked for.

    MII's `stream` keyword is accepted: whether a call streams is the method's (`stream`, or
    `generate` with a `streaming_fn`), so it changes nothing. `lora` names the LoRA adapter the
    prompts run under (None: the base model).
    """
    gen, _ = split_mii_stream(gen)
    lora = gen.get("lora")
    gen = {k: v for k, v in gen.items() if k != "lora"}
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise TypeError(f"lora must be an adapter's name (a non-empty str) or None, got {lora!r}")
    params = SamplingParams.from_kwargs(**gen)
    request = pb.GenerateRequest(prompts=prompts_to_proto(normalise_prompts(prompts)),
                                 params=params_to_proto(params, fields=gen), lora=lora or "")
    return request, params.logprobs is not None


def _error(exc: grpc.RpcError, address: str) -> Exception:
    """The Python exception a failed call stands for."""
    rejected = rejection(exc)
    if rejected is not None:
        return rejected
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return PermissionError(f"fastgen deployment at {address} refused the call: {details} "
                               "(pass api_key= or set FASTGEN_API_KEY)")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ConnectionError(f"fastgen deployment at {address} is unavailable: {details}")
    return RuntimeError(f"fastgen deployment at {address} failed the call ({code.name}): {details}")


def _message_dict(msg: Any) -> dict[str, Any]:
    """A message as plain Python values (ints stay ints, unlike protobuf's JSON mapping)."""
    out: dict[str, Any] = {}
    for field in msg.DESCRIPTOR.fields:
        value = getattr(msg, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[field.name] = dict(value)
        elif field.is_repeated:
            out[field.name] = [_message_dict(v) if field.message_type is not None else v for v in value]
        elif field.message_type is not None:
            out[field.name] = _message_dict(value)
        else:
            out[field.name] = value
    return out


def _tokenize_request(texts: str | list[str], add_special_tokens: bool) -> pb.TokenizeRequest:
    if isinstance(texts, str):
        texts = [texts]
    elif not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise TypeError(f"texts must be a str or a list of str, got {type(texts).__name__}")
    return pb.TokenizeRequest(texts=list(texts), add_special_tokens=add_special_tokens)


def _health_name(status: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def _health_failure(exc: grpc.RpcError) -> str:
    """What a failed health check reports: the service is unknown, or the server is unreachable."""
    return "SERVICE_UNKNOWN" if exc.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"


def _completions(reply: pb.GenerateResponse, with_logprobs: bool) -> list[Response]:
    return [response_from_completion(c, with_logprobs) for c in reply.completions]


def resolve(deployment_name_or_address: str) -> tuple[str, dict | None]:
    """`host:port` as is, or a deployment on this machine -> (address, its record).

    As MII's `mii.client(model_or_deployment_name)`: a deployment name, or the model name or path
    it was started with, which names the deployment `<basename>-mii-deployment` (MII's default).
    """
    target = deployment_name_or_address
    if not isinstance(target, str) or not target:
        raise TypeError(f"expected a deployment name, a model name or path, or 'host:port', got {target!r}")
    if _ADDRESS.match(target) and not os.path.exists(target):
        return target, None
    tried = []
    for name in dict.fromkeys((target, default_deployment_name(target))):
        try:
            registry.check_name(name)
        except ValueError:
            continue  # a path or hub id is no deployment name itself; its default name may be one
        tried.append(name)
        record = registry.live_record(name)
        if record is not None:
            return f"{connect_host(record['host'])}:{record['port']}", record
    running = registry.live_names()
    raise ValueError(f"no running deployment named {' or '.join(map(repr, tried)) or repr(target)} on this machine "
                     f"(running: {', '.join(running) if running else 'none'}; records in "
                     f"{registry.deployments_dir()}); pass 'host:port' to reach another machine")


def _token_ids(reply: pb.TokenizeResponse, texts: str | list[str]) -> list[int] | list[list[int]]:
    ids = [list(t.ids) for t in reply.token_ids]
    return ids[0] if isinstance(texts, str) else ids


class _ClientCore:
    """What `Client` and `AsyncClient` share: the deployment's address and identity, the credentials,
    how each call is built and its reply read (the module's functions), and how a failed call
    reads (`_error`). The two subclasses add only the blocking or awaiting of the channel."""

    def __init__(self, address: str, deployment_name: str | None, pid: int | None, api_key: str | None) -> None:
        self.address = address
        self.deployment_name = deployment_name
        self.pid = pid
        self._metadata = auth_metadata(client_api_key(api_key))

    def _forget(self) -> None:
        """Drop the stopped deployment's record on this machine."""
        if self.deployment_name is not None:
            registry.remove_record(self.deployment_name, self.pid)

    def __repr__(self) -> str:
        name = f" {self.deployment_name!r}" if self.deployment_name else ""
        return f"<fastgen {type(self).__name__}{name} at {self.address}>"


class Client(_ClientCore):
    """A blocking connection to a deployment. `client(prompts, **gen)` is `client.generate(...)`.

    `api_key`: the key to present (default: the first of `FASTGEN_API_KEY`); `tls_root_cert`:
    the certificate (file) to verify a TLS server against, None for plain TCP.
    """

    def __init__(self, address: str, *, deployment_name: str | None = None, pid: int | None = None,
                 process: subprocess.Popen | None = None, api_key: str | None = None,
                 tls_root_cert: str | None = None) -> None:
        super().__init__(address, deployment_name, pid if pid is not None else (process.pid if process else None),
                         api_key)
        self._process = process
        self._channel = open_channel(address, CHANNEL_OPTIONS, tls_root_cert)
        self._stub = pb_grpc.FastGenStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _unary(self, rpc: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return getattr(self._stub, rpc)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc, self.address) from None

    def generate(self, prompts: Any, streaming_fn: Callable[[list[Response]], Any] | None = None,
                 **gen: Any) -> list[Response]:
        """Complete every prompt; one Response per prompt (per prompt and choice with n > 1), in order.

        With `streaming_fn`, it is called with `[delta]` for every delta as it arrives (any number of
        prompts; see `Response.prompt_index`/`index`), and the final Responses are still returned.
        """
        if streaming_fn is None:
            request, with_logprobs = _request(prompts, gen)
            return _completions(self._unary("Generate", request), with_logprobs)
        deltas = []
        for delta in self.stream(prompts, **gen):
            deltas.append(delta)
            streaming_fn([delta])
        return merge_deltas(deltas)

    __call__ = generate

    def stream(self, prompts: Any, **gen: Any) -> Iterator[Response]:
        """Yield deltas as the server produces them; closing the iterator early cancels the requests."""
        request, with_logprobs = _request(prompts, gen)
        call = self._stub.GenerateStream(request, metadata=self._metadata)
        try:
            for msg in call:
                yield response_from_completion(msg, with_logprobs)
        except grpc.RpcError as exc:
            raise _error(exc, self.address) from None
        finally:
            call.cancel()

    def tokenize(self, texts: str | list[str], add_special_tokens: bool = True) -> list[int] | list[list[int]]:
        """Token ids of a text (a list of ids), or of each text of a list."""
        return _token_ids(self._unary("Tokenize", _tokenize_request(texts, add_special_tokens)), texts)

    def model_info(self) -> dict[str, Any]:
        """Model, engine configuration and (behind a load balancer) each replica's state."""
        return _message_dict(self._unary("ModelInfo", pb.ModelInfoRequest()))

    def health(self, service: str = "", timeout: float = 2.0) -> str:
        """The standard health check: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNREACHABLE"."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return _health_failure(exc)
        return _health_name(reply.status)

    def terminate_server(self, timeout: float = 60.0) -> None:
        """Stop the deployment (every replica) and wait until its process is gone."""
        try:
            self._unary("Terminate", pb.TerminateRequest(), timeout=10)
        except ConnectionError:  # already gone
            pass
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"the deployment process {self._process.pid} did not exit "
                                   f"within {timeout} s") from None
        elif self.pid is not None:
            if not wait_until(lambda: not pid_alive(self.pid), timeout):
                raise TimeoutError(f"the deployment process {self.pid} did not exit within {timeout} s")
        elif not wait_until(lambda: self.health(timeout=1.0) == "UNREACHABLE", timeout, interval=0.2):
            raise TimeoutError(f"the deployment at {self.address} still answers {timeout} s after Terminate")
        self._forget()
        self.close()

    def close(self) -> None:
        """Close the connection (the deployment keeps running)."""
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient(_ClientCore):
    """The asyncio client: `await client.generate(...)`, `async for delta in client.stream(...)`;
    `api_key` and `tls_root_cert` as for `Client`."""

    def __init__(self, address: str, *, deployment_name: str | None = None, pid: int | None = None,
                 api_key: str | None = None, tls_root_cert: str | None = None) -> None:
        super().__init__(address, deployment_name, pid, api_key)
        self._tls_root_cert = tls_root_cert
        if tls_root_cert is not None:
            read_pem("tls_root_cert", tls_root_cert)  # a bad file fails here, not on first use
        self._channel: grpc.aio.Channel | None = None

    def _stubs(self) -> tuple[pb_grpc.FastGenStub, health_pb2_grpc.HealthStub]:
        # Created on first use so the channel belongs to the event loop that uses it.
        if self._channel is None:
            self._channel = open_channel(self.address, CHANNEL_OPTIONS, self._tls_root_cert, asynchronous=True)
        return pb_grpc.FastGenStub(self._channel), health_pb2_grpc.HealthStub(self._channel)

    async def _unary(self, rpc: str, request: Any, timeout: float | None = None) -> Any:
        try:
            return await getattr(self._stubs()[0], rpc)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise _error(exc, self.address) from None

    async def generate(self, prompts: Any, streaming_fn: Callable[[list[Response]], Any] | None = None,
                       **gen: Any) -> list[Response]:
        """As `Client.generate`; `streaming_fn` may be a plain function or a coroutine function."""
        if streaming_fn is None:
            request, with_logprobs = _request(prompts, gen)
            return _completions(await self._unary("Generate", request), with_logprobs)
        deltas = []
        async for delta in self.stream(prompts, **gen):
            deltas.append(delta)
            result = streaming_fn([delta])
            if inspect.isawaitable(result):
                await result
        return merge_deltas(deltas)

    __call__ = generate

    async def stream(self, prompts: Any, **gen: Any) -> AsyncIterator[Response]:
        """Yield deltas as they arrive; leaving the loop early (or cancelling the task) cancels the requests."""
        request, with_logprobs = _request(prompts, gen)
        call = self._stubs()[0].GenerateStream(request, metadata=self._metadata)
        try:
            async for msg in call:
                yield response_from_completion(msg, with_logprobs)
        except grpc.RpcError as exc:
            raise _error(exc, self.address) from None
        finally:
            call.cancel()

    async def tokenize(self, texts: str | list[str], add_special_tokens: bool = True) -> list[int] | list[list[int]]:
        """As `Client.tokenize`."""
        return _token_ids(await self._unary("Tokenize", _tokenize_request(texts, add_special_tokens)), texts)

    async def model_info(self) -> dict[str, Any]:
        """As `Client.model_info`."""
        return _message_dict(await self._unary("ModelInfo", pb.ModelInfoRequest()))

    async def health(self, service: str = "", timeout: float = 2.0) -> str:
        """As `Client.health`."""
        try:
            reply = await self._stubs()[1].Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return _health_failure(exc)
        return _health_name(reply.status)

    async def terminate_server(self, timeout: float = 60.0) -> None:
        """As `Client.terminate_server`."""
        try:
            await self._unary("Terminate", pb.TerminateRequest(), timeout=10)
        except ConnectionError:  # already gone
            pass
        deadline = time.monotonic() + timeout
        while not await self._gone():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the deployment at {self.address} did not stop within {timeout} s")
            await asyncio.sleep(0.1)
        self._forget()
        await self.close()

    async def _gone(self) -> bool:
        if self.pid is not None:
            return not pid_alive(self.pid)
        return await self.health(timeout=1.0) == "UNREACHABLE"

    async def close(self) -> None:
        """Close the connection (the deployment keeps running)."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def client(deployment_name_or_address: str, *, asynchronous: bool = False, api_key: str | None = None,
           tls_root_cert: str | None = None) -> Client | AsyncClient:
    """Connect to a running deployment by its name (on this machine) or by 'host:port' (anywhere).

    As in MII, the model name or path the deployment was started with finds it too (its default
    name is `<model basename>-mii-deployment`); a name nothing runs under is a ValueError listing
    what runs. `api_key` defaults to the first key of `FASTGEN_API_KEY`; `tls_root_cert` to the certificate
    a local TLS deployment recorded (its own, right for a self-signed one), else plain TCP.
    """
    address, record = resolve(deployment_name_or_address)
    name = record["name"] if record else None
    pid = record["pid"] if record else None
    if tls_root_cert is None and record and record.get("tls_cert"):
        tls_root_cert = record["tls_cert"]
    options = dict(deployment_name=name, pid=pid, api_key=api_key, tls_root_cert=tls_root_cert)
    return AsyncClient(address, **options) if asynchronous else Client(address, **options)
