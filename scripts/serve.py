"""Serve a model: `python scripts/serve.py [--model DIR] [--port 50050] [--replica-num N] ...`.

With no arguments it serves the bundled demo model on 127.0.0.1:50050 (gRPC: fastgen.v1 and MII's
modelresponse service, health, reflection). `--enable-restful-api` adds the REST gateway.
Without `--api-key` (or `FASTGEN_API_KEY`) every method is open to whoever reaches the port;
`--host 0.0.0.0` exposes it on every interface, so set a key (and `--tls-cert/--tls-key`) first.
Stop it with Ctrl-C, SIGTERM, a Terminate call or REST's /terminate. `--help` lists every option.
"""

import sys

from fastgen.serving.deploy.launcher import main

if __name__ == "__main__":
    sys.exit(main())
