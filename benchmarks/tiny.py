"""`--tiny`, every benchmark's smoke-test mode.

`tests/test_benchmarks.py` runs each benchmark with `--tiny` (in CI, as part
of `make test`), so a benchmark that no longer runs against the code it
measures fails there, not when its figures are next needed. A tiny run takes
seconds and its figures mean nothing.
"""

from __future__ import annotations

import argparse


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None,
               **tiny) -> argparse.Namespace:
    """`parser.parse_args(argv)` with a `--tiny` flag that sets each of `tiny`'s
    arguments (by dest) to its value.

    Example:
        args = tiny.parse_args(parser, repeats=1, steps=200)
    """
    shown = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in tiny.items())
    parser.add_argument("--tiny", action="store_true",
                        help=f"a smoke test of seconds, its figures meaningless ({shown})")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in tiny.items():
            setattr(args, name, value)
    return args
