"""Translation between the wire messages and fastgen's types (SamplingParams, prompts, Response).

Kept free of any server or client state so both sides, and the replica router, share one
definition of what a field means.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from fastgen.api import normalise_prompts
from fastgen.outputs import Response
from fastgen.sampling_params import FieldValueError, SamplingParams
from fastgen.structured_outputs import StructuredOutputsParams
from fastgen.serving.backend import ModelInfo, Prompt, ReplicaInfo
from fastgen.serving.grpc.proto import fastgen_v1_pb2 as pb
from fastgen.serving.grpc.proto import modelresponse_pb2 as mii_pb



def prompts_to_proto(prompts: Sequence[Prompt]) -> list[pb.Prompt]:
    """Normalised prompts -> `Prompt` messages."""
    return [pb.Prompt(text=p) if isinstance(p, str) else pb.Prompt(token_ids=pb.TokenIds(ids=p)) for p in prompts]


def prompts_from_proto(prompts: Sequence[pb.Prompt]) -> list[Prompt]:
    """`Prompt` messages -> str / token-id prompts; an empty list or an unset prompt is a
    FieldValueError naming `prompts`."""
    out: list[Prompt] = []
    for i, prompt in enumerate(prompts):
        kind = prompt.WhichOneof("prompt")
        if kind is None:
            raise FieldValueError(f"prompts[{i}] has neither text nor token_ids", "prompts")
        out.append(prompt.text if kind == "text" else list(prompt.token_ids.ids))
    return normalise_prompts(out)


def _repeated(name: str) -> bool:
    return pb.SamplingParams.DESCRIPTOR.fields_by_name[name].is_repeated


_MAPS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields
                  if f.message_type is not None and f.message_type.GetOptions().map_entry)
"""SamplingParams fields that are proto maps (`logit_bias`)."""


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """A `SamplingParams` message -> validated SamplingParams; unset fields take the defaults."""
    kwargs: dict[str, Any] = {}
    for name in SamplingParams.field_names():
        if name in _MAPS:
            if len(getattr(msg, name)):
                kwargs[name] = dict(getattr(msg, name))
        elif _repeated(name):
            if len(getattr(msg, name)):
                kwargs[name] = list(getattr(msg, name))
        elif msg.HasField(name):
            value = getattr(msg, name)
            kwargs[name] = structured_outputs_from_proto(value) if name == "structured_outputs" else value
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> dict[str, Any]:
    """A `StructuredOutputs` message -> the dict `SamplingParams.structured_outputs` takes (an unset
    constraint is left out, so SamplingParams refuses it with its own message)."""
    out: dict[str, Any] = {}
    kind = msg.WhichOneof("constraint")
    if kind == "choice":
        out["choice"] = list(msg.choice.choices)
    elif kind is not None:
        out[kind] = getattr(msg, kind)
    for name in ("whitespace_pattern", "disable_any_whitespace"):
        if msg.HasField(name):
            out[name] = getattr(msg, name)
    return out


def structured_outputs_to_proto(spec: StructuredOutputsParams) -> pb.StructuredOutputs:
    """`StructuredOutputsParams` -> message (reasoning_end is the server's, not the caller's: not sent)."""
    msg = pb.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace)
    if spec.kind == "choice":
        msg.choice.choices.extend(spec.choice)
    else:
        setattr(msg, spec.kind, getattr(spec, spec.kind))
    if spec.whitespace_pattern is not None:
        msg.whitespace_pattern = spec.whitespace_pattern
    return msg


def params_to_proto(params: SamplingParams, fields: Iterable[str] | None = None) -> pb.SamplingParams:
    """SamplingParams -> message, with every set field (or only `fields`) filled in."""
    msg = pb.SamplingParams()
    for name in SamplingParams.field_names() if fields is None else fields:
        value = getattr(params, name)
        if value is None:
            continue
        if name in _MAPS:
            getattr(msg, name).update(value)
        elif _repeated(name):
            getattr(msg, name).extend(value)
        elif name == "structured_outputs":
            msg.structured_outputs.CopyFrom(structured_outputs_to_proto(StructuredOutputsParams.from_value(value)))
        else:
            setattr(msg, name, value)
    return msg


def completion_from_response(response: Response) -> pb.Completion:
    """A Response (final or delta) -> `Completion` message."""
    msg = pb.Completion(
        prompt_index=response.prompt_index, index=response.index, text=response.generated_text,
        token_ids=response.token_ids, finish_reason=response.finish_reason, prompt_length=response.prompt_length,
        generated_length=response.generated_length, num_cached_tokens=response.num_cached_tokens,
        request_id=response.request_id,
    )
    for position in response.logprobs or ():
        msg.logprobs.add(token_ids=list(position), logprobs=list(position.values()))
    for position in response.prompt_logprobs or ():
        msg.prompt_logprobs.add(token_ids=list(position or ()), logprobs=list((position or {}).values()))
    return msg


def response_from_completion(msg: pb.Completion, with_logprobs: bool) -> Response:
    """A `Completion` message -> Response (logprobs None unless the request asked for them)."""
    logprobs = [dict(zip(p.token_ids, p.logprobs)) for p in msg.logprobs] if with_logprobs else None
    prompt_logprobs = [dict(zip(p.token_ids, p.logprobs)) or None for p in msg.prompt_logprobs] or None
    return Response(
        generated_text=msg.text, prompt_length=msg.prompt_length, generated_length=msg.generated_length,
        finish_reason=msg.finish_reason, token_ids=list(msg.token_ids), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, index=msg.index,
        prompt_index=msg.prompt_index, num_cached_tokens=msg.num_cached_tokens, request_id=msg.request_id,
    )


def _float32_as_written(value: float) -> float:
    """MII sends floats as float32 (0.7 arrives as 0.699999988): recover the shortest decimal
    that rounds to the same float32, which is what the client wrote."""
    bits = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == bits:
            return candidate
    return value


def value_from_mii(value: mii_pb.Value) -> Any:
    """An MII `Value` -> Python value (a `Dictionary` becomes a dict)."""
    kind = value.WhichOneof("oneof_values")
    if kind is None:
        raise ValueError("a query_kwargs value has none of svalue/ivalue/fvalue/bvalue/mvalue set")
    if kind == "mvalue":
        return kwargs_from_mii(value.mvalue.values)
    raw = getattr(value, kind)
    return _float32_as_written(raw) if kind == "fvalue" else raw


def kwargs_from_mii(query_kwargs: Mapping[str, mii_pb.Value]) -> dict[str, Any]:
    """MII `query_kwargs` -> generation keyword arguments."""
    return {key: value_from_mii(value) for key, value in query_kwargs.items()}


def value_to_mii(value: Any) -> mii_pb.Value:
    """A Python value -> MII `Value` (what an MII client sends); lists have no MII encoding."""
    if isinstance(value, bool):
        return mii_pb.Value(bvalue=value)
    if isinstance(value, int):
        return mii_pb.Value(ivalue=value)
    if isinstance(value, float):
        return mii_pb.Value(fvalue=value)
    if isinstance(value, str):
        return mii_pb.Value(svalue=value)
    if isinstance(value, dict):
        return mii_pb.Value(mvalue=mii_pb.Dictionary(values={k: value_to_mii(v) for k, v in value.items()}))
    raise TypeError(f"MII's Value cannot carry a {type(value).__name__} ({value!r})")


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfoResponse:
    """`info` as the typed service's `ModelInfoResponse`."""
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info) if f.name != "replicas"}
    return pb.ModelInfoResponse(**fields, replicas=[pb.ReplicaInfo(**dataclasses.asdict(r)) for r in info.replicas])


def model_info_from_proto(message: pb.ModelInfoResponse) -> ModelInfo:
    """A replica's `ModelInfoResponse` (read by the replica router) as a `ModelInfo`."""
    fields = {f.name: getattr(message, f.name) for f in dataclasses.fields(ModelInfo) if f.name != "replicas"}
    for name in ("engine_config", "plan", "plan_reasons"):
        fields[name] = dict(fields[name])
    replicas = [ReplicaInfo(**{f.name: getattr(r, f.name) for f in dataclasses.fields(ReplicaInfo)})
                for r in message.replicas]
    return ModelInfo(**fields, replicas=replicas)
