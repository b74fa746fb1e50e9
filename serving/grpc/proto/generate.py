"""Regenerate the committed gRPC stubs: `python serving/grpc/proto/generate.py`.

Needs grpcio-tools (the version pinned in pyproject's `serving` extra: generated stubs refuse
older grpcio/protobuf runtimes). protoc writes `import x_pb2` in the `_grpc` modules; they are
rewritten to import through the package so the stubs load as `fastgen.serving.grpc.proto.*`.
"""

from __future__ import annotations

import os
import re
import sys

from grpc_tools import protoc

PROTO_DIR = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("fastgen_v1.proto", "modelresponse.proto")
PACKAGE = "fastgen.serving.grpc.proto"


def main() -> int:
    """Run protoc on every proto here and fix the imports of the generated modules."""
    include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={PROTO_DIR}", f"--pyi_out={PROTO_DIR}",
            f"--grpc_python_out={PROTO_DIR}", *(os.path.join(PROTO_DIR, p) for p in PROTOS)]
    if protoc.main(args) != 0:
        print("protoc failed", file=sys.stderr)
        return 1
    for proto in PROTOS:
        path = os.path.join(PROTO_DIR, proto.removesuffix(".proto") + "_pb2_grpc.py")
        with open(path, encoding="utf-8") as f:
            source = f.read()
        source = re.sub(r"^import (\w+_pb2) as", rf"from {PACKAGE} import \1 as", source, flags=re.M)
        with open(path, "w", encoding="utf-8") as f:
            f.write(source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
