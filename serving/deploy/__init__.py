"""Deployments: the launcher process, `fastgen.serve()`, replicas behind a front end, the per-user
registry that `fastgen.client(name)` reads, and the process and port helpers they share."""
