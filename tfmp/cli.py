"""The `tfmp` command line."""

from __future__ import annotations

import argparse
import os
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
    launch = commands.add_parser(
        "launch",
        help="run a program as several clients of one run on this machine",
        description="Starts N processes of the program after --, each a client of one "
        "multi-client run on loopback ports (tfmp.initialize() in the program reads "
        "its settings), prefixes their output, and stops all if one fails; with "
        "--max-restarts, starts them all again. SIGTERM to it is passed to every "
        "client, which saves a BackupAndRestore backup and exits with status 143.",
    )
    launch.add_argument("--num-processes", type=int, required=True)
    launch.add_argument("--devices-per-process", type=int, required=True)
    launch.add_argument("--timeout", type=float, default=None, help="seconds before all are stopped")
    launch.add_argument(
        "--step-timeout", type=float, default=None,
        help="seconds a step may take before the clients count as stuck (sets TFMP_STEP_TIMEOUT)",
    )
    launch.add_argument(
        "--first-step-timeout", type=float, default=None,
        help="the same for the first step of each fit/evaluate/predict (sets TFMP_FIRST_STEP_TIMEOUT)",
    )
    launch.add_argument(
        "--max-restarts", type=int, default=0,
        help="start every client again after a failure, up to this many times (the "
        "program resumes from its newest BackupAndRestore backup)",
    )
    launch.add_argument(
        "--restart-num-processes", type=int, default=None, help="clients of a restarted run (default: as many)"
    )
    launch.add_argument(
        "--restart-devices-per-process", type=int, default=None,
        help="devices of each client of a restarted run (default: as many)",
    )
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- python train.py ...")
    args = parser.parse_args(argv)
    if args.command == "launch":
        from tfmp.launch import launch as launch_clients

        program = args.program[1:] if args.program[:1] == ["--"] else args.program
        for variable, seconds in (("TFMP_STEP_TIMEOUT", args.step_timeout), ("TFMP_FIRST_STEP_TIMEOUT", args.first_step_timeout)):
            if seconds is not None:
                os.environ[variable] = str(seconds)  # the clients inherit it
        try:
            return launch_clients(
                program,
                args.num_processes,
                args.devices_per_process,
                args.timeout,
                max_restarts=args.max_restarts,
                restart_processes=args.restart_num_processes,
                restart_devices_per_process=args.restart_devices_per_process,
            )
        except ValueError as error:
            parser.error(str(error))
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
