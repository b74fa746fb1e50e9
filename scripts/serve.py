"""Serve a model: `python scripts/serve.py [--model DIR] [--port 50050] [--replica-num N] ...`.

With no arguments it serves the bundled demo model on port 50050 (gRPC: fastgen.v1 and MII's
modelresponse service, health, reflection). `--enable-restful-api` adds the REST gateway.
Stop it with Ctrl-C, SIGTERM or a Terminate call. `--help` lists every option.
"""

import sys

from fastgen.serving.launcher import main

if __name__ == "__main__":
    sys.exit(main())
