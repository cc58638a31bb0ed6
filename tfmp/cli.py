"""The `tfmp` command line."""

from __future__ import annotations

import argparse
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tfmp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a small Transformer LM on a 2x4 (batch x model) mesh"
    )
    demo.add_argument("--epochs", type=int, default=3)
    demo.add_argument(
        "--mesh", default="2x4", help="batch x model mesh shape, e.g. 2x4 or 1x8"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from tfmp import demo as demo_lib

        try:
            shape = tuple(int(size) for size in args.mesh.lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) != 2:
            parser.error(f"--mesh {args.mesh!r}: expected BATCHxMODEL such as 2x4")
        demo_lib.run(shape, epochs=args.epochs)
    return 0
