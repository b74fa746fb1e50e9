"""Small process and port helpers shared by the launcher, the replica router and `fastgen.serve`."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def check_port_free(host: str, port: int) -> None:
    """Raise OSError with a clear message if nothing may listen on host:port now."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR lets us take a port in TIME_WAIT, as the server will; a listener still blocks.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(f"port {port} on {host} is already in use (another deployment or program "
                              "listens there); choose another port") from None
            raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def connect_host(host: str) -> str:
    """The address a local client dials for a server bound to `host` (wildcards -> loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "[::]") else host


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, wait up to `timeout`, then SIGKILL; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def reap_in_background(proc: subprocess.Popen, name: str) -> threading.Thread:
    """Wait for `proc` in a daemon thread, so that however it ends (even stopped by another process)
    its exit status is collected at once and it leaves no zombie; the thread never keeps us alive."""
    thread = threading.Thread(target=proc.wait, name=f"fastgen-reaper-{name}", daemon=True)
    thread.start()
    return thread


def write_json_atomic(path: str, data: dict) -> None:
    """Write JSON so that a reader never sees a half-written file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None if it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll `predicate()` until it is true (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
