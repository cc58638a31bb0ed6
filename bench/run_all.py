"""Runs every benchmark in bench/ and writes their ratios to bench/RESULTS.md.

Runs overhead.py, eager_call.py, tensor_parallel.py, callbacks.py,
pipeline.py, compare_jax.py, breakdown.py, largest_model.py,
memory_growth.py, generic_path.py, model_zoo.py, long_context.py and
experts.py one after another, each in its own process (the machine's cores go to one
benchmark at a time), captures what each prints, and takes from it every
ratio with its target:

- a line `RESULT measure="..." ratio=1.234 target=<=1.00 status=met|missed`
  (compare_jax.py, eager_call.py, pipeline.py, breakdown.py,
  largest_model.py, memory_growth.py, generic_path.py, model_zoo.py,
  long_context.py and experts.py print these; any benchmark may);
- otherwise the benchmark's own table, read by a parser below that knows its
  format (overhead.py, tensor_parallel.py, callbacks.py).

`--devices cpu` (the default) runs every benchmark on logical CPU devices, with
the GPUs hidden from it (`CUDA_VISIBLE_DEVICES=-1`), and writes
bench/RESULTS.md. `--devices gpu` passes `--devices gpu` to every benchmark
that takes the flag (one GPU split into logical GPUs, or several real GPUs with
NCCL: see bench/devices.py) and writes bench/RESULTS-gpu.md; a benchmark without
the flag runs on CPU devices as with `--devices cpu`, and is marked
"(CPU: no --devices)" in the table.

bench/RESULTS.md gets the date, the machine (CPU model, cores, RAM, load,
TensorFlow / Keras / JAX versions, GPU if any) and one table: benchmark |
measure | ratio | target | met?, then each benchmark's full output, folded.
A measure without a target (e.g. step time against 1x1 in
tensor_parallel.py) is listed with target "-". A benchmark that fails or
prints nothing parseable is listed as such, and run_all exits non-zero.

Usage (from the repository root):

    python bench/run_all.py                 # every benchmark, full size
    python bench/run_all.py --quick         # every benchmark's smoke mode
    python bench/run_all.py --quick compare_jax.py callbacks.py   # a subset
    python bench/run_all.py --devices gpu   # on GPUs -> bench/RESULTS-gpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Callable

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BENCHMARKS = (
    "overhead.py",
    "eager_call.py",
    "tensor_parallel.py",
    "callbacks.py",
    "pipeline.py",
    "compare_jax.py",
    "breakdown.py",
    "largest_model.py",
    "memory_growth.py",
    "generic_path.py",
    "model_zoo.py",
    "long_context.py",
    "experts.py",
)
# callbacks.py, long_context.py and experts.py have no --quick: these are their
# short runs (experts.py takes about 20 s whole).
QUICK_ARGS = {"callbacks.py": ["--rounds", "1"], "long_context.py": ["--lengths", "32,64,128"], "experts.py": []}


@dataclasses.dataclass
class Row:
    """One ratio of one benchmark, as in the results table."""

    measure: str
    ratio: str
    target: str = "-"
    met: str = "-"  # "yes", "no" or "-" (no target)


@dataclasses.dataclass
class Run:
    """One benchmark's process: its output and the rows taken from it."""

    script: str
    command: list[str]
    returncode: int
    seconds: float
    output: str
    rows: list[Row]
    cpu_fallback: bool = False  # --devices gpu, but the script has no --devices flag


# --- reading each benchmark's output -----------------------------------------


def result_lines(output: str) -> list[Row]:
    """`RESULT measure="..." ratio=... target=... status=...` lines."""
    rows = []
    for line in output.splitlines():
        if not line.startswith("RESULT "):
            continue
        fields = dict(item.split("=", 1) for item in shlex.split(line[len("RESULT "):]))
        target = fields.get("target", "-")
        rows.append(
            Row(fields["measure"], fields["ratio"], _spaced(target), _met(fields.get("status")))
        )
    return rows


def overhead(output: str) -> list[Row]:
    # | tfmp 1x1 / keras | 1.23 | 1.11 | 1.108 | 1.05-1.12 | <= 1.10 | pass |
    pattern = re.compile(
        r"^\| (?P<name>[^|]+?) \| [\d.]+ \| [\d.]+ \| (?P<ratio>[\d.]+) \| [^|]* "
        r"\| (?P<target><= [\d.]+) \| (?P<result>pass|FAIL) \|$"
    )
    return [
        Row(f"step time {m['name']}", m["ratio"], m["target"], _met(m["result"]))
        for m in map(pattern.match, output.splitlines())
        if m
    ]


def tensor_parallel(output: str) -> list[Row]:
    # | 1x4 | 1,234 | 1.012 | 5,678 | 1.000 | 1.52 |
    pattern = re.compile(
        r"^\| 1x(?P<n>\d+) \| [\d,]+ \| (?P<memory>[\d.]+) \| [\d,]+ "
        r"\| (?P<comm>[\d.]+|nan) \| (?P<step>[\d.]+) \|$"
    )
    rows = []
    for m in map(pattern.match, output.splitlines()):
        if not m or m["n"] == "1":  # 1x1 is the reference: every ratio is 1 or nan
            continue
        mesh = f"1x{m['n']}"
        memory, comm = float(m["memory"]), float(m["comm"])
        rows += [
            Row(f"memory / ideal, {mesh}", m["memory"], "<= 1.05", _met(memory <= 1.05)),
            Row(f"comm / Megatron minimum, {mesh}", m["comm"], "1.00",
                _met(round(comm, 2) == 1.00)),
            Row(f"step time / 1x1, {mesh}", m["step"]),
        ]
    # | 2x4 | all-gather | 1,234 | 1.023 | 5,678 | 0.877 |   (the fully sharded table)
    sharded = re.compile(
        r"^\| (?P<mesh>\d+x\d+) \| (?P<lowering>all-gather|all-reduce) \| [\d,]+ "
        r"\| (?P<memory>[\d.]+) \| [\d,]+ \| (?P<comm>[\d.]+) \|$"
    )
    for m in map(sharded.match, output.splitlines()):
        if not m:
            continue
        if m["lowering"] == "all-reduce":  # DTensor's own lowering, for comparison
            rows.append(Row(
                f"fully sharded batch-axis bytes / ZeRO-3 minimum, {m['mesh']}, gathers as "
                "all-reduces", m["comm"],
            ))
            continue
        rows += [
            Row(f"fully sharded memory / (total / 8), {m['mesh']}", m["memory"], "<= 1.05",
                _met(float(m["memory"]) <= 1.05)),
            Row(f"fully sharded batch-axis bytes / ZeRO-3 minimum, {m['mesh']}", m["comm"],
                "<= 1.10", _met(float(m["comm"]) <= 1.10)),
        ]
    return rows


def callbacks(output: str) -> list[Row]:
    # | DeviceMemoryMonitor + GradientSyncMonitor | 12.34 | 1.012 | <= 1.02 | pass |
    pattern = re.compile(
        r"^\| (?P<name>[^|]+?) \| [\d.]+ \| (?P<ratio>[\d.]+) \| (?P<target><= [\d.]+) "
        r"\| (?P<result>pass|FAIL) \|$"
    )
    return [
        Row(f"step time with / without {m['name']}", m["ratio"], m["target"],
            _met(m["result"]))
        for m in map(pattern.match, output.splitlines())
        if m
    ]


PARSERS: dict[str, Callable[[str], list[Row]]] = {
    "overhead.py": overhead,
    "tensor_parallel.py": tensor_parallel,
    "callbacks.py": callbacks,
}


def _met(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return {"met": "yes", "pass": "yes", "missed": "no", "FAIL": "no"}.get(str(value), "-")


def _spaced(target: str) -> str:
    """`<=1.00` as `<= 1.00`."""
    return re.sub(r"^([<>]=?)\s*", r"\1 ", target)


# --- running -----------------------------------------------------------------


def takes_devices(script: str) -> bool:
    """Whether a benchmark has the `--devices cpu|gpu` flag (its own, or
    bench/devices.py's `add_argument`)."""
    source = (BENCH / script).read_text()
    return '"--devices"' in source or "bench_devices.add_argument(" in source


def run_benchmark(script: str, quick: bool, timeout: float, devices: str = "cpu") -> Run:
    extra = (QUICK_ARGS.get(script, ["--quick"]) if quick else [])
    env = dict(os.environ)
    cpu_fallback = devices == "gpu" and not takes_devices(script)
    if devices == "gpu" and not cpu_fallback:
        extra = ["--devices", "gpu", *extra]
    else:
        # CPU devices only: a GPU left visible would take the ops TensorFlow
        # places by default (a 1x1 mesh, plain Keras) while the meshes stay on CPU.
        env["CUDA_VISIBLE_DEVICES"] = "-1"
    command = [sys.executable, str(BENCH / script), *extra]
    note = " (on CPU: it has no --devices flag)" if cpu_fallback else ""
    print(f"running {' '.join([Path(command[0]).name, *command[1:]])}{note} ...", flush=True)
    started = time.perf_counter()
    try:
        process = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
        )
        returncode, output = process.returncode, process.stdout
        if returncode != 0:
            output += "\n--- stderr (last 3000 characters) ---\n" + process.stderr[-3000:]
    except subprocess.TimeoutExpired as expired:
        returncode = -1
        output = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (
            expired.stdout or ""
        )
        output += f"\n--- timed out after {timeout:.0f} s ---"
    seconds = time.perf_counter() - started
    rows = result_lines(output) or PARSERS.get(script, lambda _: [])(output)
    if returncode != 0:
        rows.append(Row("(failed: exit code {})".format(returncode), "-"))
    elif not rows:
        rows.append(Row("(no ratio found in the output)", "-"))
    print(f"  {seconds:.0f} s, exit {returncode}, {len(rows)} row(s)", flush=True)
    return Run(script, command, returncode, seconds, output, rows, cpu_fallback)


def machine() -> list[str]:
    """Lines describing the machine and the library versions."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or platform.machine()
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
    return [
        f"- CPU: {cpu}; {os.cpu_count()} cores ({usable} usable by this process)",
        f"- RAM: {ram}",
        f"- load average (1, 5, 15 min) when the run started: {load}",
        f"- GPU: {gpu()}",
        f"- OS: {platform.platform()}; Python {platform.python_version()}",
        "- " + ", ".join(f"{name} {version(name)}" for name in
                         ("tensorflow", "keras", "jax", "jaxlib", "tfmp")),
    ]


def gpu() -> str:
    if shutil.which("nvidia-smi"):
        try:
            listing = subprocess.run(
                ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            listing = ""
        if listing:
            return "; ".join(listing.splitlines())
    return "none (benchmarks ran on CPU devices)"


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def table(runs: list[Run]) -> list[str]:
    """The results table, one row per ratio, as Markdown lines."""
    lines = ["| benchmark | measure | ratio | target | met? |", "|---|---|---:|---|---|"]
    for run in runs:
        name = run.script + (" (CPU: no --devices)" if run.cpu_fallback else "")
        for row in run.rows:
            lines.append(
                f"| {name} | {row.measure} | {row.ratio} | {row.target} | {row.met} |"
            )
    return lines


def write_results(path: Path, runs: list[Run], quick: bool, started: datetime.datetime,
                  machine_lines: list[str], devices: str = "cpu") -> str:
    mode = "quick (`--quick`: smoke-test sizes, not representative)" if quick else "full"
    flags = (" --devices gpu" if devices == "gpu" else "") + (" --quick" if quick else "")
    if devices == "gpu":
        fallback = [run.script for run in runs if run.cpu_fallback]
        where = (
            "Devices: GPUs for every benchmark that takes `--devices gpu` (one GPU split "
            "into logical GPUs, DTensor without NCCL; or one logical GPU per real GPU, "
            "DTensor on NCCL: see bench/devices.py and each benchmark's output)"
            + (f"; on CPU devices, having no `--devices` flag: {', '.join(fallback)}."
               if fallback else ".")
        )
    else:
        where = "Devices: logical CPU devices (GPUs hidden from every benchmark)."
    lines = [
        "# Benchmark results" + (" on GPU" if devices == "gpu" else ""),
        "",
        f"Written by `python bench/run_all.py{flags}` on "
        f"{started:%Y-%m-%d %H:%M} (local time); mode: {mode}. Every ratio compares "
        "configurations measured side by side in the same run.",
        "",
        where,
        "",
        "## Machine",
        "",
        *machine_lines,
        "",
        "## Ratios",
        "",
        *table(runs),
    ]
    total = sum(run.seconds for run in runs)
    lines += [
        "",
        "Time per benchmark: "
        + ", ".join(f"{run.script} {run.seconds:.0f} s" for run in runs)
        + f"; total {total / 60:.1f} min"
        + (" (target with `--devices gpu`: under 8 min)." if devices == "gpu" else "."),
        "",
        "## Outputs",
        "",
    ]
    for run in runs:
        script = Path(run.command[1]).relative_to(ROOT)
        command = " ".join(["python", str(script), *run.command[2:]])
        lines += [
            f"<details><summary>{run.script}: <code>{command}</code> "
            f"(exit {run.returncode}, {run.seconds:.0f} s)</summary>",
            "",
            "```text",
            run.output.rstrip(),
            "```",
            "",
            "</details>",
            "",
        ]
    text = "\n".join(lines)
    path.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's smoke mode")
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds allowed per benchmark (3600)"
    )
    parser.add_argument(
        "--devices", choices=("cpu", "gpu"), default="cpu",
        help="cpu: logical CPU devices (default); gpu: pass --devices gpu to every "
        "benchmark that takes it",
    )
    parser.add_argument(
        "--output", type=Path, default=None,
        help="where to write (bench/RESULTS.md; with --devices gpu, bench/RESULTS-gpu.md)",
    )
    parser.add_argument(
        "scripts", nargs="*", metavar="SCRIPT", help=f"a subset of {', '.join(BENCHMARKS)}"
    )
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = BENCH / ("RESULTS-gpu.md" if args.devices == "gpu" else "RESULTS.md")
    unknown = [s for s in args.scripts if s not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}: choose from {BENCHMARKS}")
    started = datetime.datetime.now()
    machine_lines = machine()  # before the benchmarks: the load average is the machine's own
    runs = [
        run_benchmark(s, args.quick, args.timeout, args.devices)
        for s in args.scripts or BENCHMARKS
    ]
    write_results(args.output, runs, args.quick, started, machine_lines, args.devices)
    print()
    print("\n".join(table(runs)))
    print(f"\nwrote {args.output}; {sum(r.seconds for r in runs) / 60:.1f} min in all")
    failed = [run.script for run in runs if run.returncode != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
