"""Persistent serving (gRPC server, clients, REST gateway, replicas).

Only the public API of `fastgen` may be imported from here. The server itself lands with the
serving issue; until then `fastgen.serve()` raises NotImplementedError saying so.
"""
