"""fastgen: a pure-PyTorch, compile-first LLM inference engine (MII/FastGen successor).

`import fastgen as mii` runs MII pipeline code:

    pipe = fastgen.pipeline("path/to/model")
    responses = pipe(["Hello", "DeepSpeed is"], max_new_tokens=64)
"""

from fastgen.api import Pipeline, pipeline
from fastgen.config import EngineConfig
from fastgen.engine import DEMO_MODEL_DIR, Engine
from fastgen.outputs import Response
from fastgen.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["DEMO_MODEL_DIR", "Engine", "EngineConfig", "Pipeline", "Response", "SamplingParams", "pipeline"]
