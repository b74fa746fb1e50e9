"""DeepSpeed-MII's `modelresponse.ModelResponse` gRPC service over a backend (the gRPC server serves it
beside fastgen's typed service, sharing its admission)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import grpc
from google.protobuf import empty_pb2

from fastgen.api import normalise_prompts, split_mii_stream
from fastgen.engine import RequestGroup
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams
from fastgen.serving.grpc.convert import kwargs_from_mii
from fastgen.serving.grpc.proto import modelresponse_pb2 as mii_pb
from fastgen.serving.grpc.proto import modelresponse_pb2_grpc as mii_grpc
from fastgen.serving.grpc.status import fail, reject

if TYPE_CHECKING:
    from fastgen.serving.grpc.server import GrpcServer


def _mii_reply(response: Response | None, text: str, started: float, accepted: float) -> mii_pb.SingleGenerationReply:
    """MII's reply for one completion; `response` None = nothing produced yet (counts unknown, 0)."""
    now = time.perf_counter()
    if response is None:
        return mii_pb.SingleGenerationReply(finish_reason="none", time_taken=now - started,
                                            model_time_taken=now - accepted)
    return mii_pb.SingleGenerationReply(
        response=text, finish_reason=response.finish_reason, prompt_tokens=response.prompt_length,
        generated_tokens=response.generated_length, time_taken=now - started, model_time_taken=now - accepted,
    )


class ModelResponseServicer(mii_grpc.ModelResponseServicer):
    """DeepSpeed-MII's modelresponse.ModelResponse over a backend.

    `query_kwargs` are generation keywords, plus MII's `stream` (a bool), which MII's server used to
    choose per-token replies: here GeneratorReply always answers in full and GeneratorReplyStream
    always streams, whatever it says. `time_taken` counts from the call's arrival,
    `model_time_taken` from the engine's acceptance of the prompts (so it leaves out parsing and
    validation).
    """

    def __init__(self, server: GrpcServer) -> None:
        self._server = server

    def _open(self, request: mii_pb.MultiStringRequest,
              context: grpc.ServicerContext) -> tuple[RequestGroup, Callable[[], None], list[tuple[int, int]]]:
        """The admitted group, its release and its completions' (prompt_index, index) keys, prompt-major."""
        prompts = normalise_prompts(list(request.request), "request")
        # MII's client adds stream=True to every streaming call; the method, not the flag, decides here.
        gen, _ = split_mii_stream(kwargs_from_mii(request.query_kwargs), "query_kwargs['stream']")
        params = SamplingParams.from_kwargs(**gen)
        group, done = self._server.admit(prompts, params, context, field="request")
        return group, done, [(p, c) for p in range(len(prompts)) for c in range(params.n)]

    def GeneratorReply(self, request: mii_pb.MultiStringRequest,
                       context: grpc.ServicerContext) -> mii_pb.MultiGenerationReply:
        """One reply per prompt (per prompt and choice with n > 1), in order."""
        started = time.perf_counter()
        try:
            group, done, _ = self._open(request, context)
        except Exception as exc:
            reject(self._server, context, exc)
        accepted = time.perf_counter()
        try:
            return mii_pb.MultiGenerationReply(
                response=[_mii_reply(r, r.generated_text, started, accepted) for r in group.results()])
        except Exception as exc:
            fail(self._server, context, exc)
        finally:
            done()

    def GeneratorReplyStream(self, request: mii_pb.MultiStringRequest,
                             context: grpc.ServicerContext) -> Iterator[mii_pb.MultiGenerationReply]:
        """Replies with an entry for every completion, in order: its new text since the last reply."""
        started = time.perf_counter()
        try:
            group, done, keys = self._open(request, context)
        except Exception as exc:
            reject(self._server, context, exc)
        accepted = time.perf_counter()
        latest: dict[tuple[int, int], Response] = {}
        try:
            for batch in group.batches():
                texts: dict[tuple[int, int], str] = {}
                for delta in batch:
                    key = (delta.prompt_index, delta.index)
                    latest[key] = delta
                    texts[key] = texts.get(key, "") + delta.generated_text
                yield mii_pb.MultiGenerationReply(response=[
                    _mii_reply(latest.get(key), texts.get(key, ""), started, accepted) for key in keys])
        except Exception as exc:
            fail(self._server, context, exc)
        finally:
            done()

    def Terminate(self, request: empty_pb2.Empty, context: grpc.ServicerContext) -> empty_pb2.Empty:
        """Stop the deployment."""
        self._server.request_termination()
        return empty_pb2.Empty()
