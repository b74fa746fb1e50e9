"""The request lifecycle, host side only: requests in, one Dynamic SplitFuse step at a time, tokens
and text out.

`Engine` (validation, stepping, isolation of failing requests), `Sequence`, `Scheduler` (the
SplitFuse policy and the per-step bookkeeping), `BlockManager` (paged KV blocks, prefix cache),
`Sampler`, the detokenizer and stop strings, and `EngineLoop` (the engine on a background thread for
servers).

May import: `fastgen.executor`, `fastgen.planning`, `fastgen.models`, `fastgen.ops` and fastgen's
data types (`fastgen.config`, `fastgen.sampling_params`, `fastgen.outputs`); never `fastgen.api`
or `fastgen.serving`.
"""

from fastgen.engine.engine import DEMO_MODEL_DIR, Engine, PreparedRequest, RequestFailed, max_prompt_chars
from fastgen.engine.loop import EngineLoop, RequestStream
from fastgen.executor.distributed import TensorParallelError

__all__ = ["DEMO_MODEL_DIR", "Engine", "EngineLoop", "PreparedRequest", "RequestFailed", "RequestStream",
           "TensorParallelError", "max_prompt_chars"]
