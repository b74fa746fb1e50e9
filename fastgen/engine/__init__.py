"""The request lifecycle, host side only: requests in, one Dynamic SplitFuse step at a time, tokens
and text out.

`Engine` (validation, stepping, isolation of failing requests), `Sequence`, `Scheduler` (the
SplitFuse policy and the per-step bookkeeping), `BlockManager` (paged KV blocks, prefix cache),
`Sampler`, the detokenizer and stop strings, `EngineLoop` (the engine on a background thread for
servers), `Deliveries` (where a producer's deltas go, and when a request's stream ends) and
`RequestGroup` (the prompts of one call read as one stream, for every entry point) and `LoRAManager`
(the LoRA adapters: names, host cache, device slots).

May import: `fastgen.executor`, `fastgen.planning`, `fastgen.models`, `fastgen.ops` and fastgen's
data types (`fastgen.config`, `fastgen.sampling_params`, `fastgen.outputs`); never `fastgen.api`
or `fastgen.serving`.
"""

from fastgen.engine.admission import PreparedRequest, max_prompt_chars
from fastgen.engine.builder import DEMO_MODEL_DIR
from fastgen.engine.engine import Engine
from fastgen.engine.lora_manager import UnknownLoRAError
from fastgen.engine.step.output import RequestFailed
from fastgen.engine.delivery import Deliveries
from fastgen.engine.loop import EngineLoop, LoopRequest
from fastgen.engine.request_group import (END, Member, RequestGroup, Sink, Submitter, full_text_prefix, merge_deltas,
                                         submit_group)
from fastgen.executor.distributed import TensorParallelError

__all__ = ["DEMO_MODEL_DIR", "END", "Deliveries", "Engine", "EngineLoop", "LoopRequest", "Member", "PreparedRequest",
           "RequestFailed", "RequestGroup", "Sink", "Submitter", "TensorParallelError", "UnknownLoRAError",
           "full_text_prefix",
           "max_prompt_chars", "merge_deltas", "submit_group"]
