from google.protobuf import empty_pb2 as _empty_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dictionary(_message.Message):
    __slots__ = ("values",)
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.MessageMap[str, Value]
    def __init__(self, values: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("svalue", "ivalue", "fvalue", "bvalue", "mvalue")
    SVALUE_FIELD_NUMBER: _ClassVar[int]
    IVALUE_FIELD_NUMBER: _ClassVar[int]
    FVALUE_FIELD_NUMBER: _ClassVar[int]
    BVALUE_FIELD_NUMBER: _ClassVar[int]
    MVALUE_FIELD_NUMBER: _ClassVar[int]
    svalue: str
    ivalue: int
    fvalue: float
    bvalue: bool
    mvalue: Dictionary
    def __init__(self, svalue: _Optional[str] = ..., ivalue: _Optional[int] = ..., fvalue: _Optional[float] = ..., bvalue: _Optional[bool] = ..., mvalue: _Optional[_Union[Dictionary, _Mapping]] = ...) -> None: ...

class SingleStringRequest(_message.Message):
    __slots__ = ("request", "query_kwargs")
    class QueryKwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    QUERY_KWARGS_FIELD_NUMBER: _ClassVar[int]
    request: str
    query_kwargs: _containers.MessageMap[str, Value]
    def __init__(self, request: _Optional[str] = ..., query_kwargs: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class MultiStringRequest(_message.Message):
    __slots__ = ("request", "query_kwargs")
    class QueryKwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    QUERY_KWARGS_FIELD_NUMBER: _ClassVar[int]
    request: _containers.RepeatedScalarFieldContainer[str]
    query_kwargs: _containers.MessageMap[str, Value]
    def __init__(self, request: _Optional[_Iterable[str]] = ..., query_kwargs: _Optional[_Mapping[str, Value]] = ...) -> None: ...

class SingleGenerationReply(_message.Message):
    __slots__ = ("response", "finish_reason", "prompt_tokens", "generated_tokens", "time_taken", "model_time_taken")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIME_TAKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_TIME_TAKEN_FIELD_NUMBER: _ClassVar[int]
    response: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    time_taken: float
    model_time_taken: float
    def __init__(self, response: _Optional[str] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., time_taken: _Optional[float] = ..., model_time_taken: _Optional[float] = ...) -> None: ...

class MultiGenerationReply(_message.Message):
    __slots__ = ("response",)
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    response: _containers.RepeatedCompositeFieldContainer[SingleGenerationReply]
    def __init__(self, response: _Optional[_Iterable[_Union[SingleGenerationReply, _Mapping]]] = ...) -> None: ...
