"""Persistent serving, by concern: `grpc/` (server, guard, wire conversion, proto), `http/` (the REST
gateway: MII's `/mii/` routes, the OpenAI API, utility routes), `deploy/` (launcher, processes,
replicas, registry, `serve()`), and what they share at this level (`backend`, `limits`, `metrics`,
`cli`, `client`).

Only the public API of `fastgen` is imported from here. Entry points: `fastgen.serve()` and
`fastgen.client()` (implemented in `deploy/deployment.py` and `client.py`), `scripts/serve.py`
(`deploy/launcher.py`), and `grpc.server.GrpcServer` to serve an engine loop inside a process.
"""
