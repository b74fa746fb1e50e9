"""Persistent serving: gRPC server, clients, REST gateway, replicas.

Only the public API of `fastgen` is imported from here. Entry points: `fastgen.serve()` and
`fastgen.client()` (implemented in `deployment.py` and `client.py`), `scripts/serve.py`
(`launcher.py`), and `grpc_server.GrpcServer` to serve an engine loop inside a process.
"""
