"""Generated gRPC stubs (committed; regenerate with `python serving/grpc/proto/generate.py`).

`fastgen_v1` is fastgen's typed API; `modelresponse` is DeepSpeed-MII's service, kept message for
message so MII clients work against a fastgen server.
"""
