"""Where fastgen keeps what it prepares once per machine (built kernels, converted checkpoints)."""

from __future__ import annotations

import os


def fastgen_cache_dir() -> str:
    """$FASTGEN_CACHE, else $XDG_CACHE_HOME/fastgen, else ~/.cache/fastgen (not created here)."""
    return os.environ.get("FASTGEN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastgen")
