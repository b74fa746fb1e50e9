"""`python -m fastgen.planning MODEL [--field value ...]`: print the plan fastgen would use here.

Each plan field is a flag of the same name (`--token_budget 512` or `--token-budget 512`), so a
shell user can try an override before passing it to `pipeline`/`serve`. The function behind it is
`fastgen.explain` (defined in `fastgen.planning.policy`).
"""

from __future__ import annotations

import argparse
import sys

from fastgen.planning.hardware import detect_hardware
from fastgen.planning.plan import PLAN_FIELDS, PLAN_SPECS, argument_type, is_bool_field
from fastgen.planning.policy import explain


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model, detection options, and one flag per plan field."""
    parser = argparse.ArgumentParser(prog="python -m fastgen.planning",
                                     description="Print the plan (and its reasons) fastgen would serve MODEL with here.")
    parser.add_argument("model", help="checkpoint directory or cached Hugging Face id (only config.json is read)")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:i (default: CUDA when available)")
    parser.add_argument("--measure", action="store_true", help="time CPU matmuls here instead of using documented rates")
    parser.add_argument("--offline", action="store_true",
                        help="plan an offline batch (what fastgen.pipeline plans) instead of a server (fastgen.serve)")
    for name in PLAN_FIELDS:
        flags = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        switch = dict(nargs="?", const=True) if is_bool_field(name) else {}  # `--cuda-graphs` alone = true
        parser.add_argument(*flags, dest=name, type=argument_type(name), default=None, **switch,
                            help=f"override the plan's {name}: {PLAN_SPECS[name].metadata['doc']}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a bad option or an impossible plan)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    overrides = {name: getattr(args, name) for name in PLAN_FIELDS if getattr(args, name) is not None}
    try:
        hardware = detect_hardware(args.device, measure=args.measure)
        explain(args.model, hardware=hardware, offline=args.offline, **overrides)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
