"""The REST gateway: one FastAPI app (`app`) with MII's `/mii/{deployment}` route, the OpenAI-compatible
API, vLLM's utility routes, health and metrics; the `Gateway` between routes and the engine backend;
and the guard (keys, body size, safe JSON) in front of them all."""
