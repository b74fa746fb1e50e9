"""fastgen: a pure-PyTorch, compile-first LLM inference engine (MII/FastGen successor).

`import fastgen as mii` runs MII pipeline code:

    pipe = fastgen.pipeline("path/to/model")
    responses = pipe(["Hello", "DeepSpeed is"], max_new_tokens=64)
"""

from typing import TYPE_CHECKING, Any

from fastgen.api import Pipeline, pipeline, serve_torchrun_rank
from fastgen.config import EngineConfig
from fastgen.engine import DEMO_MODEL_DIR, Engine
from fastgen.mii_options import MIICompatibilityWarning
from fastgen.outputs import Response
from fastgen.planning.policy import explain, plan_deployment
from fastgen.sampling_params import SamplingParams

if TYPE_CHECKING:  # the serving stack (grpc) is imported only when serve()/client() is called
    from fastgen.serving.client import AsyncClient, Client

__version__ = "0.1.0"


def serve(model_name_or_path: str | None = None, **config: Any) -> "Client":
    """Start a persistent deployment (gRPC, optionally REST) in its own process; return its `Client`.

    MII's options (`deployment_name`, `replica_num`, `port_number`, `enable_restful_api`, ...), MII's
    `model_config={...}` / `mii_config={...}` dicts (mapped onto fastgen's options; see the README's
    MII section), the security options (`api_key`, `tls_cert`, `tls_key`, `max_pending_requests`)
    and every `EngineConfig` field are accepted; see `fastgen.serving.deploy.deployment.serve`.
    """
    from fastgen.serving.deploy.deployment import serve as _serve

    return _serve(model_name_or_path, **config)


def client(deployment_name_or_address: str, *, asynchronous: bool = False, api_key: str | None = None,
           tls_root_cert: str | None = None) -> "Client | AsyncClient":
    """Connect to a running deployment by name on this machine (its deployment name, or the model name
    or path it serves, which MII resolves to `<basename>-mii-deployment`) or by 'host:port';
    `asynchronous=True` returns an `AsyncClient`. `api_key` (default: `FASTGEN_API_KEY`) is sent on every call;
    `tls_root_cert` is the certificate file to verify a TLS server against."""
    from fastgen.serving.client import client as _client

    return _client(deployment_name_or_address, asynchronous=asynchronous, api_key=api_key,
                   tls_root_cert=tls_root_cert)


__all__ = ["DEMO_MODEL_DIR", "Engine", "EngineConfig", "MIICompatibilityWarning", "Pipeline", "Response", "SamplingParams", "explain", "plan_deployment", "pipeline", "client", "serve", "serve_torchrun_rank"]
