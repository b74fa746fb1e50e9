"""Where running deployments are recorded, so `fastgen.client(name)` finds them on this machine.

One small JSON file per deployment name (address, pid, model) in a per-user directory:
`$FASTGEN_DEPLOYMENTS_DIR` if set, else `$XDG_CACHE_HOME/fastgen/deployments` (`~/.cache/...`).
The launcher writes its record once it serves and removes it when it stops; a record whose
process is gone is stale and ignored (MII kept its deployment file in /tmp and never cleaned it).
"""

from __future__ import annotations

import os
import re

from fastgen.serving.deploy.processes import pid_alive, read_json, write_json_atomic

ENV_DIR = "FASTGEN_DEPLOYMENTS_DIR"
"""Environment variable that overrides the registry directory (tests point it at a temp dir)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def deployments_dir() -> str:
    """The registry directory (created if missing)."""
    path = os.environ.get(ENV_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fastgen", "deployments")
    os.makedirs(path, exist_ok=True)
    return path


def check_name(name: str) -> str:
    """A deployment name is a file name: letters, digits, '.', '_', '-'."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"deployment_name must be letters, digits, '.', '_' or '-' (not starting with a "
                         f"punctuation mark), got {name!r}")
    return name


def record_path(name: str) -> str:
    """The record file of deployment `name`."""
    return os.path.join(deployments_dir(), check_name(name) + ".json")


def log_path(name: str) -> str:
    """The log file `fastgen.serve` sends deployment `name`'s output to."""
    return os.path.join(deployments_dir(), check_name(name) + ".log")


def write_record(name: str, record: dict) -> None:
    """Record a running deployment."""
    write_json_atomic(record_path(name), record)


def live_record(name: str) -> dict | None:
    """The record of deployment `name` if its process is alive; a stale record is removed."""
    path = record_path(name)
    record = read_json(path)
    if record is None:
        return None
    if not isinstance(record.get("pid"), int) or not pid_alive(record["pid"]):
        remove_record(name, record.get("pid"))
        return None
    return record


def remove_record(name: str, pid: int | None) -> None:
    """Delete the record of `name` if it still belongs to process `pid`."""
    path = record_path(name)
    record = read_json(path)
    if record is not None and record.get("pid") == pid:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def live_names() -> list[str]:
    """Names of the deployments recorded as running on this machine."""
    names = sorted(f.removesuffix(".json") for f in os.listdir(deployments_dir()) if f.endswith(".json"))
    return [n for n in names if _NAME.match(n) and live_record(n) is not None]
