"""The gRPC side: the server (fastgen's typed service and MII's `modelresponse`), what a call passes
before it runs (keys, the pending budget), the statuses it ends with, translation between wire
messages and fastgen's types, and the committed stubs under `proto/`."""
