"""`python -m fastgen.explain MODEL [--field value ...]`: print the plan fastgen would use here.

Each plan field is a flag of the same name (`--token_budget 512` or `--token-budget 512`), so a
shell user can try an override before passing it to `pipeline`/`serve`. The function itself is
`fastgen.explain` (defined in `fastgen.policy`); `fastgen/__init__.py` does not import this module,
so `-m` runs it without importing it twice.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Callable
from typing import Any

from fastgen.hardware import detect_hardware
from fastgen.plan import PLAN_FIELDS
from fastgen.policy import explain


def _bool(text: str) -> bool:
    """true/false, yes/no, on/off, 1/0."""
    value = text.strip().lower()
    if value in ("true", "yes", "on", "1"):
        return True
    if value in ("false", "no", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _buckets(text: str) -> tuple[int, ...]:
    """Comma-separated token counts: 1,2,4,8."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def _memory(text: str) -> int | float:
    """Bytes (an int) or a fraction of free memory (a float such as 0.5)."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (int) or a fraction (float), got {text!r}") from None


_PARSERS: dict[str, Callable[[str], Any]] = {
    "dtype": str,
    "attention_backend": str,
    "compile": str,
    "cuda_graphs": _bool,
    "buckets": _buckets,
    "token_budget": int,
    "max_seqs": int,
    "block_size": int,
    "kv_cache_memory": _memory,
    "tensor_parallel": int,
    "replica_num": int,
}


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model, detection options, and one flag per plan field."""
    parser = argparse.ArgumentParser(prog="python -m fastgen.explain",
                                     description="Print the plan (and its reasons) fastgen would serve MODEL with here.")
    parser.add_argument("model", help="checkpoint directory or cached Hugging Face id (only config.json is read)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:i (default: CUDA when available)")
    parser.add_argument("--measure", action="store_true", help="time CPU matmuls here instead of using documented rates")
    for name in PLAN_FIELDS:
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        parser.add_argument(*flags, dest=name, type=_PARSERS[name], default=None, help=f"override the plan's {name}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad option or an impossible plan)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in PLAN_FIELDS if getattr(args, name) is not None}
    try:
        hardware = detect_hardware(args.device, measure=args.measure)
        explain(args.model, hardware=hardware, **overrides)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module rebinds the name `fastgen.explain` from the function to the module;
    making the module callable keeps `fastgen.explain(model, ...)` working either way."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return explain(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
