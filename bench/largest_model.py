"""The largest GPT-style model that trains under one per-device memory limit.

Under the same per-device memory limit L on 8 devices, finds the widest GPT-style
LM (the model of `bench/tensor_parallel.py`, tfmp's tensor-parallel layers;
fixed layers, 8 heads, FFN = 4 x width, fixed vocabulary and sequence; the
width is searched in steps of `--step`) that trains one Adam step under:

- `tf.distribute.MirroredStrategy` over the 8 devices (every device holds every
  weight and optimizer slot): the baseline;
- tfmp tensor parallel, ("batch", "model") = 1x8;
- tfmp fully sharded (`fully_shard=True`), 8x1 (weights and slots split over
  "batch" only) and 2x4 (split over both axes);

and prints each one's parameter count, and for each tfmp mode a line
`RESULT measure="..." ratio=<params / MirroredStrategy's> target=>=6 status=...`
for bench/run_all.py. Target: >= 6x the parameters (about 8 is the most one
can expect; the width moves in steps, so a strategy may use less of L than
another, and the table shows each one's accounted bytes / L).

What "fits under L" means:

- `--devices cpu` (the default; CPU devices have no per-device allocator or
  limit): accounted bytes. Per device, parameters + optimizer variables as
  `tfmp.inspect.summary.bytes_per_device` counts them on the built, trained
  model, + one gradient per parameter laid out as the parameter (what a step
  holds besides activations). Activations, workspace and the transient buffers
  of gathers and all-reduces are not counted. The search (doubling the width,
  then bisecting) uses a prediction of these bytes: one small "probe" model is
  built under each strategy to read how much of each variable a device holds,
  and every variable's size at any width follows from plain (no strategy)
  builds at two small widths (each size is c * width**k). Then the found model is built under its strategy in a fresh process
  and trains one real step on 8 CPU devices; its measured accounted bytes must
  be <= L (else the width steps down). L defaults to 8 MiB (quick: 2 MiB).
- `--devices gpu`: a real out-of-memory test, activations included. The 8
  devices are logical GPUs of `--limit-mib` MiB each (one GPU split in 8; or 8
  real GPUs capped at L, with DTensor on NCCL), so L is enforced by
  TensorFlow's allocator. The accounted search gives an upper bound on the
  width; each trial then trains one step at a width in a fresh process (an
  out-of-memory error leaves a process unusable), starting at the bound and
  stepping down by 30% of the width (about half the weights) while a trial runs out of memory, then
  bisecting between the widest that fitted and the narrowest that did not
  (at most `--max-trials` per strategy). Trials of different strategies run
  side by side, as many at a time as 80% of the GPU's memory holds at 8 x L.
  Each trial also reports the peak memory TensorFlow's allocator saw on the
  fullest device. L defaults to 1024 MiB (quick: 256 MiB).

Global batch 8 in every case: MirroredStrategy and 8x1 give each device 1
sequence, 2x4 gives 4, 1x8 gives every device all 8 (tensor parallelism splits
the weights, not the batch); on GPU that is part of what each device holds.

Usage (from the repository root):

    python bench/largest_model.py                  # CPU, accounted, L = 8 MiB
    python bench/largest_model.py --quick          # CPU, a small smoke run
    python bench/largest_model.py --devices gpu    # 8 logical GPUs of 1024 MiB
    python bench/largest_model.py --devices gpu --limit-mib 4096
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import devices as bench_devices  # noqa: E402  (imports no TensorFlow)

NUM_DEVICES = 8
TARGET = 6.0


@dataclasses.dataclass(frozen=True)
class Mode:
    label: str
    mesh: tuple[int, int] | None  # ("batch", "model"); None: MirroredStrategy
    fully_shard: bool = False


MODES = {
    "mirrored": Mode("MirroredStrategy, 8 replicas", None),
    "tp": Mode("tfmp tensor parallel 1x8", (1, 8)),
    "fsdp": Mode("tfmp fully sharded 8x1", (8, 1), fully_shard=True),
    "fsdp-tp": Mode("tfmp fully sharded 2x4", (2, 4), fully_shard=True),
}


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int
    limit_mib: float
    step: int  # width granularity


SIZES = {
    ("cpu", False): Size(layers=2, heads=8, vocab=512, seq=32, batch=8, limit_mib=8, step=8),
    ("cpu", True): Size(layers=1, heads=8, vocab=256, seq=16, batch=8, limit_mib=2, step=8),
    ("gpu", False): Size(layers=4, heads=8, vocab=8192, seq=128, batch=8, limit_mib=1024, step=64),
    ("gpu", True): Size(layers=2, heads=8, vocab=4096, seq=64, batch=8, limit_mib=256, step=64),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_devices.add_argument(parser)
    parser.add_argument("--quick", action="store_true", help="a small model and limit: a smoke run")
    parser.add_argument("--limit-mib", type=float, help="the per-device memory limit L, MiB")
    parser.add_argument("--layers", type=int, help="transformer blocks (cpu 2, gpu 4; quick 1/2)")
    parser.add_argument("--step", type=int, help="width granularity (cpu 8, gpu 64)")
    parser.add_argument(
        "--modes", default="mirrored,tp,fsdp,fsdp-tp",
        help=f"comma-separated, from {','.join(MODES)} (mirrored is always run)",
    )
    parser.add_argument(
        "--max-trials", type=int, default=5,
        help="gpu: real one-step trials per strategy (default 5)",
    )
    parser.add_argument(
        "--jobs", type=int, help="trial processes at a time (default: one per strategy)"
    )
    parser.add_argument("--trial", choices=tuple(MODES), help=argparse.SUPPRESS)
    parser.add_argument("--width", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = SIZES[(args.devices, args.quick)]
    args.size = dataclasses.replace(
        size,
        limit_mib=args.limit_mib or size.limit_mib,
        layers=args.layers or size.layers,
        step=args.step or size.step,
    )
    args.modes = ["mirrored"] + [m for m in args.modes.split(",") if m and m != "mirrored"]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {list(MODES)}")
    return args


def limit_bytes(size: Size) -> int:
    return int(size.limit_mib * 2**20)


def build_gpt(size: Size, width: int):
    """`build_gpt` of bench/tensor_parallel.py at this size, FFN = 4 x width.

    The same layers, names and split, restated here rather than imported:
    importing tensor_parallel.py splits the host CPU into 8 devices at import
    (and initializes TensorFlow's devices), after which a GPU can no longer
    be split into logical GPUs.
    """
    import keras

    import tfmp

    tokens = keras.Input((size.seq,), dtype="int32")
    x = tfmp.layers.VocabParallelEmbedding(size.vocab, width, name="embed")(tokens)
    for i in range(size.layers):
        attention = tfmp.layers.ParallelMultiHeadAttention(
            size.heads, width // size.heads, name=f"attention_{i}"
        )
        x = keras.layers.LayerNormalization(name=f"norm_a{i}")(
            x + attention(x, x, use_causal_mask=True)
        )
        h = tfmp.layers.ColumnParallelDense(4 * width, activation="gelu", name=f"ffn_in_{i}")(x)
        h = tfmp.layers.RowParallelDense(width, name=f"ffn_out_{i}")(h)
        x = keras.layers.LayerNormalization(name=f"norm_f{i}")(x + h)
    head = keras.layers.Dense(size.vocab, name="head")
    logits = tfmp.layers.Sharded(head, {"kernel": (None, True), "bias": (True,)})(x)
    return keras.Model(tokens, logits, name="gpt")


def strategy_for(mode: Mode, names: list[str]):
    import tensorflow as tf

    import tfmp

    if mode.mesh is None:
        return tf.distribute.MirroredStrategy(
            names, cross_device_ops=bench_devices.mirrored_cross_device_ops()
        )
    mesh = tfmp.DeviceMesh(mode.mesh, ("batch", "model"), names)
    return tfmp.ModelParallelStrategy(mesh, fully_shard=mode.fully_shard)


def compiled_gpt(size: Size, width: int):
    import keras

    model = build_gpt(size, width)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,  # every strategy alike (Keras's "auto" picks per strategy)
    )
    return model


def accounted(model) -> int:
    """Bytes on the fullest device: parameters + optimizer variables
    (`bytes_per_device`) + one gradient per parameter, laid out as it."""
    from tfmp.inspect.summary import bytes_per_device

    return max(k["total"] + k["parameters"] for k in bytes_per_device(model).values())


# --- a trial: one real training step, in a fresh process ----------------------


def trial(args: argparse.Namespace) -> int:
    size, mode = args.size, MODES[args.trial]
    gpu = args.devices == "gpu"
    names = bench_devices.setup(
        args.devices, NUM_DEVICES, memory_limit_mb=int(size.limit_mib) if gpu else None
    )
    import keras
    import numpy as np
    import tensorflow as tf

    result: dict = {"mode": args.trial, "width": args.width, "ok": False,
                    "devices": bench_devices.describe()}
    started = time.perf_counter()
    try:
        keras.utils.set_random_seed(0)
        with strategy_for(mode, names).scope():
            model = compiled_gpt(size, args.width)
        result["params"] = int(model.count_params())
        tokens = np.random.default_rng(0).integers(
            0, size.vocab, size=(size.batch, size.seq + 1)
        ).astype("int32")
        if gpu:
            for name in names:
                tf.config.experimental.reset_memory_stats(name)
        history = model.fit(
            tokens[:, :-1], tokens[:, 1:], batch_size=size.batch, epochs=1, verbose=0
        )
        loss = float(history.history["loss"][-1])
        result.update(ok=math.isfinite(loss), loss=loss, accounted=accounted(model))
        if not math.isfinite(loss):
            result["error"] = f"loss {loss}"
        if gpu:
            result["peak"] = max(
                tf.config.experimental.get_memory_info(name)["peak"] for name in names
            )
    except tf.errors.ResourceExhaustedError as error:
        result.update(oom=True, error="out of memory: " + str(error).strip().splitlines()[0][:300])
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result), flush=True)
    return 0


def run_trial(args: argparse.Namespace, mode: str, width: int, env: dict) -> dict:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--devices", args.devices,
        "--trial", mode, "--width", str(width), "--limit-mib", str(args.size.limit_mib),
        "--layers", str(args.size.layers), "--step", str(args.size.step),
    ] + (["--quick"] if args.quick else [])
    process = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in process.stdout.splitlines() if line.startswith("{")]
    if process.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = process.stderr[-2000:]
    oom = any(s in tail for s in ("ResourceExhausted", "OOM", "out of memory", "Out of memory"))
    return {"mode": mode, "width": width, "ok": False, "oom": oom,
            "error": f"exit {process.returncode}: " + (tail.strip().splitlines() or ["?"])[-1][:300],
            "stderr": tail}


def fits(result: dict, args: argparse.Namespace) -> bool:
    if not result.get("ok"):
        return False
    # On CPU nothing enforces L: the accounted bytes must be under it.
    return args.devices == "gpu" or result["accounted"] <= limit_bytes(args.size)


# --- the accounted search (in this process, on 8 CPU devices) -----------------


REFERENCE_WIDTHS = (64, 128)  # plain builds that give every variable's size law


class Predictor:
    """Predicts a mode's accounted bytes per device at any width: each
    variable's full size (from a plain build at that width) / the share of it
    one device holds under the mode's strategy (read from a probe build)."""

    def __init__(self, size: Size, names: list[str]):
        self.size, self.names = size, names
        self.shares: dict[str, dict[str, float]] = {}
        self.plain: dict[int, dict[str, tuple[int, int]]] = {}

    def probe(self, key: str) -> dict[str, float]:
        if key not in self.shares and MODES[key].mesh is None:
            self.shares[key] = {}  # MirroredStrategy: every device holds everything
        if key not in self.shares:
            from tfmp.inspect.summary import placements

            with strategy_for(MODES[key], self.names).scope():
                model = compiled_gpt(self.size, 8 * self.size.step)
                model.optimizer.build(model.trainable_variables)
            self.shares[key] = {
                _stable(row.path): math.prod(row.shard_shape) / max(1, math.prod(row.shape))
                for row in placements(model)
                if not row.is_slot
            }
        return self.shares[key]

    def variables(self, width: int) -> dict[str, tuple[int, int]]:
        """path -> (elements, itemsize) of every parameter at `width`.

        Each dimension is a constant (vocabulary, heads) or proportional to the
        width (width, FFN, head size), so a variable's size is c * width**k,
        k in 0..2: read from plain builds at two small widths, not by building
        (and initializing) every candidate.
        """
        if not self.plain:
            import numpy as np

            for reference in REFERENCE_WIDTHS:
                model = compiled_gpt(self.size, reference)
                self.plain[reference] = {
                    _stable(v.path): (math.prod(v.shape), np.dtype(v.dtype).itemsize)
                    for v in model.variables
                }
        if width not in self.plain:
            (w1, small), (w2, large) = ((w, self.plain[w]) for w in REFERENCE_WIDTHS)
            shapes = {}
            for path, (n1, item) in small.items():
                k = round(math.log(large[path][0] / n1, w2 / w1))
                shapes[path] = (n1 * width**k // w1**k, item)
            self.plain[width] = shapes
        return self.plain[width]

    def params(self, width: int) -> int:
        return sum(n for n, _ in self.variables(width).values())

    def bytes(self, key: str, width: int) -> float:
        shares = self.probe(key)
        # parameter + gradient + Adam's two slots, each laid out as the parameter
        return sum(
            4 * n * item * shares.get(path, 1.0) for path, (n, item) in self.variables(width).items()
        )


def _stable(path: str) -> str:
    """A variable path without Keras's per-build suffix of the unnamed
    `Sharded` wrapper (`sharded_3/head/kernel` -> `sharded/head/kernel`)."""
    return re.sub(r"^sharded_\d+/", "sharded/", path)


def largest_width(fits_at, step: int) -> int:
    """The largest multiple of `step` with fits_at(width), by doubling then bisecting
    (0 if not even `step` fits)."""
    if not fits_at(step):
        return 0
    low = step
    while fits_at(2 * low):
        low *= 2
    high = 2 * low  # low fits, high does not
    while high - low > step:
        middle = (low + high) // 2 // step * step
        if fits_at(middle):
            low = middle
        else:
            high = middle
    return low


# --- the parent ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trial:
        return trial(args)
    child_env = dict(os.environ)
    if args.devices == "gpu" and bench_devices.gpu_memory_mb() is None:
        sys.exit("--devices gpu: no GPU found (nvidia-smi lists none).")
    if args.devices == "gpu":
        # The search runs on CPU devices; only the trials' processes see the GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    started = time.perf_counter()
    size, limit = args.size, limit_bytes(args.size)
    names = bench_devices.setup("cpu", NUM_DEVICES)
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    predictor = Predictor(size, names)
    # Each strategy's trials run in a thread of their own (each trial a
    # process), started as soon as its accounted bound is known, MirroredStrategy
    # (the slowest to trace: 8 replicas) first: on CPU the processes share the
    # cores; on GPU each holds its own 8 x L.
    bounds: dict[str, int] = {}
    futures = {}
    trials: list[dict] = []
    jobs = args.jobs or len(args.modes)
    if args.devices == "gpu" and not args.jobs:
        # each trial process holds up to 8 x L of the GPU: keep 80% of it free of them
        total = bench_devices.gpu_memory_mb() or 0
        jobs = max(1, min(jobs, int(0.8 * total / (NUM_DEVICES * size.limit_mib))))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for key in args.modes:
            bounds[key] = largest_width(lambda w, k=key: predictor.bytes(k, w) <= limit, size.step)
            predicted = {w: predictor.bytes(key, w) for w in widths_below(bounds[key], size.step)}
            futures[key] = pool.submit(
                search_real, args, key, bounds[key], predicted, child_env, trials
            )
        search_s = time.perf_counter() - started
        found = {key: future.result() for key, future in futures.items()}
    trials.sort(key=lambda t: (args.modes.index(t["mode"]), t.get("order", 0)))

    devices = (
        f"{NUM_DEVICES} logical CPU devices; fits = accounted bytes (parameters + gradients "
        "+ Adam slots) <= L, and one real training step"
        if args.devices == "cpu" else
        f"{NUM_DEVICES} GPU devices ({trials[0].get('devices', '?') if trials else '?'}); "
        "fits = one real training step without running out of memory"
    )
    print(f"largest trainable GPT-style model, per-device limit L = {size.limit_mib:g} MiB "
          f"({limit:,} bytes); {devices}")
    print(f"model: bench/tensor_parallel.py's GPT, {size.layers} layers, "
          f"{size.heads} heads, FFN 4 x width, vocabulary {size.vocab}, sequence {size.seq}, "
          f"global batch {size.batch}, Adam; width in steps of {size.step}; "
          f"tensorflow {tf.__version__}, keras {keras.__version__}")
    print()
    print("trials (each one training step in a fresh process):")
    for t in trials:
        what = (f"ok, loss {t['loss']:.3f}, accounted {t['accounted']:,} B"
                if t.get("ok") else t.get("error", "failed"))
        if t.get("peak") is not None:
            what += f", peak {t['peak']:,} B"
        print(f"  {t['mode']:<9} width {t['width']:>5}: {what} ({t.get('seconds', '?')} s)")
    print()
    print("| strategy | width | parameters | accounted bytes/device (<= L) | / L | "
          "predicted | peak bytes/device | params / MirroredStrategy's |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = found["mirrored"].get("params") or 0
    for key in args.modes:
        r = found[key]
        width = r.get("width", 0)
        params = r.get("params", 0)
        ratio = params / base if base else float("nan")
        peak = f"{r['peak']:,}" if r.get("peak") is not None else "-"
        acc = f"{r['accounted']:,}" if r.get("accounted") is not None else "-"
        acc += f" | {r['accounted'] / limit:.2f}" if r.get("accounted") is not None else " | -"
        predicted = f"{predictor.bytes(key, width):,.0f}" if width else "-"
        print(f"| {MODES[key].label} | {width} | {params:,} | {acc} | {predicted} | {peak} "
              f"| {ratio:.2f} |")
    print()
    for key in args.modes[1:]:
        params = found[key].get("params", 0)
        ratio = params / base if base else 0.0
        status = "met" if base and ratio >= TARGET else "missed"
        print(f'RESULT measure="largest trainable GPT params, {MODES[key].label} / '
              f'MirroredStrategy, {NUM_DEVICES} devices of {size.limit_mib:g} MiB" '
              f"ratio={ratio:.2f} target=>={TARGET:g} status={status}")
    over = [key for key in args.modes[1:]
            if base and found[key].get("params", 0) / base > NUM_DEVICES]
    if over and found["mirrored"].get("accounted"):
        used = found["mirrored"]["accounted"] / limit
        print(f"(a ratio above {NUM_DEVICES}: MirroredStrategy's largest width uses {used:.0%} "
              f"of L and the next width, {found['mirrored']['width'] + size.step}, is over it; "
              f"the width moves in steps of {size.step})")
    print(f"\naccounted search {search_s:.0f} s; total {time.perf_counter() - started:.0f} s")
    failed = [key for key in args.modes if not found[key].get("ok")]
    return 1 if failed else 0


def widths_below(bound: int, step: int, count: int = 4) -> list[int]:
    """The widths a CPU search may step down to (predictions made up front)."""
    return [w for w in range(bound, max(0, bound - count * step), -step) if w > 0]


def search_real(args, key: str, bound: int, predicted: dict[int, float], env: dict,
                trials: list[dict]) -> dict:
    """The largest width that trains one real step, starting at the accounted
    bound and stepping down; returns that trial's result (with its width)."""
    step = args.size.step
    if bound == 0:
        return {"mode": key, "width": 0, "ok": False, "error": "even the smallest width is over L"}
    best: dict = {}
    failed_at = None
    width = bound
    budget = args.max_trials if args.devices == "gpu" else 3
    while width >= step and budget > 0:
        budget -= 1
        result = run_trial(args, key, width, env)
        result["predicted"] = predicted.get(width)
        result["order"] = len([t for t in trials if t["mode"] == key])
        trials.append(result)
        if fits(result, args):
            best = result
            if failed_at is None or failed_at - width <= step:
                break
            width = (width + failed_at) // 2 // step * step  # bisect up
            if width == best["width"]:
                break
            continue
        if not result.get("ok") and not result.get("oom"):
            break  # an error that is not out of memory: stepping down will not help
        failed_at = width
        low = best.get("width", 0)
        if args.devices == "cpu":  # over L by a little: the next width down
            width -= step
        else:
            # down by 30% of the width (about half the weights) until one
            # fits, then bisect between the two
            width = max(step, ((low + width) // 2 if low else width * 7 // 10) // step * step)
            if width <= low or width >= failed_at:
                break
    if best:
        return best
    last = trials[-1] if trials else {}
    return {"mode": key, "width": 0, "ok": False, "error": last.get("error", "no trial fitted")}


if __name__ == "__main__":
    sys.exit(main())
