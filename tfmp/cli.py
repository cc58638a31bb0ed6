"""The `tfmp` command line.

Building the parser imports neither TensorFlow nor Keras: `tfmp --help`
answers at once, and each command imports what it needs only after
`--verbose` has decided TensorFlow's logging.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from tfmp import _env

_VERBOSE_HELP = (
    "show TensorFlow's own log lines (C++ and absl: device setup, DTensor, "
    "grappler); without it the command sets TF_CPP_MIN_LOG_LEVEL=3 unless you set it"
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `tfmp` and its commands."""
    parser = argparse.ArgumentParser(
        prog="tfmp", description="Model parallelism for Keras 3 on TensorFlow."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="train a small Transformer LM on a 2x4 (batch x model) mesh",
        description="Trains a one-block Transformer LM with model.fit on a (batch, model) "
        "mesh, split Megatron-style (tfmp.demo.MEGATRON_RULES), then prints tfmp.summary "
        "and the loss of every epoch. Without enough GPUs or TPU cores the mesh is "
        "simulated on the CPU.",
    )
    demo.add_argument("--epochs", type=int, default=3, help="epochs to train (default: 3)")
    demo.add_argument(
        "--mesh", default="2x4", help="BATCHxMODEL mesh shape, e.g. 2x4 (default) or 1x8"
    )
    demo.add_argument("--verbose", action="store_true", help=_VERBOSE_HELP)
    launch = commands.add_parser(
        "launch",
        help="run a program as several clients of one run on this machine",
        description="Starts N processes of the program after --, each a client of one "
        "multi-client run on loopback ports (tfmp.initialize() in the program reads "
        "its settings), prefixes their output, and stops all if one fails; with "
        "--max-restarts, starts them all again. SIGTERM to it is passed to every "
        "client, which saves a BackupAndRestore backup and exits with status 143.",
    )
    launch.add_argument("--num-processes", type=int, required=True, help="clients to start")
    launch.add_argument(
        "--devices-per-process", type=int, required=True,
        help="logical devices of each client (its CPU split with tfmp.simulate_devices)",
    )
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
    launch.add_argument(
        "--verbose", action="store_true", help=_VERBOSE_HELP + " (the clients inherit it)"
    )
    launch.add_argument("program", nargs=argparse.REMAINDER, help="-- python train.py ...")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `tfmp` command line on `argv` (default: `sys.argv[1:]`);
    returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verbose:
        os.environ[_env.TF_LOG_LEVEL] = "0"
    else:
        os.environ.setdefault(_env.TF_LOG_LEVEL, _env.QUIET_LOG_LEVEL)
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
        try:
            shape = tuple(int(size) for size in args.mesh.lower().split("x"))
        except ValueError:
            shape = ()
        if len(shape) != 2 or min(shape) < 1:
            parser.error(f"--mesh {args.mesh!r}: expected BATCHxMODEL such as 2x4")
        _env.import_tensorflow()
        from tfmp import demo as demo_lib

        demo_lib.run(shape, epochs=args.epochs)
    return 0
