"""What tfmp costs a Keras model that runs outside any tfmp strategy.

Times an eager `layer(x)` call (a Dense layer on a host array, Keras' own path)
in three fresh processes, side by side in one run:

1. plain Keras, tfmp never imported;
2. `import tfmp`, no strategy made: tfmp patches nothing at import, so this
   must equal (1);
3. after a `ModelParallelStrategy` was made, which installs tfmp's Keras
   integrations (`tfmp/integrations/keras.py`): the layer is not on a tfmp
   mesh, so `Layer.__call__`'s wrapper only decides to pass through.

Prints each case's median call time over interleaved rounds and the ratios of
(2) and (3) to (1), with a RESULT line per ratio for bench/run_all.py.
Targets: (2) / (1) <= 1.02 (nothing to pay), (3) / (1) <= 1.05.

Usage (from the repository root):

    python bench/eager_call.py            # 5 rounds of 2000 calls per case
    python bench/eager_call.py --quick    # 2 rounds of 300 calls
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = {
    "plain Keras": "",
    "tfmp imported": "import tfmp",
    "tfmp strategy made": (
        "import tfmp\n"
        "tfmp.ModelParallelStrategy(tfmp.DeviceMesh((1,), ('batch',)))"
    ),
}
TARGETS = {"tfmp imported": 1.02, "tfmp strategy made": 1.05}

_TIMER = """
import json, os, time
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import numpy as np
import keras
{setup}
layer = keras.layers.Dense(64)
x = np.ones((8, 32), "float32")
layer(x)  # build
for _ in range(50):
    layer(x)
times = []
for _ in range({calls}):
    start = time.perf_counter()
    layer(x)
    times.append(time.perf_counter() - start)
print(json.dumps(sorted(times)[len(times) // 2]))
"""


def median_call_seconds(setup: str, calls: int, devices: str = "cpu") -> float:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if devices == "cpu":  # else the layer runs where TensorFlow puts it: the first GPU
        env["CUDA_VISIBLE_DEVICES"] = "-1"
    finished = subprocess.run(
        [sys.executable, "-c", _TIMER.format(setup=setup, calls=calls)],
        capture_output=True, text=True, env=env, timeout=600, check=True,
    )
    return json.loads(finished.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--devices", choices=("cpu", "gpu"), default="cpu",
                        help="where the layer runs: the CPU (default) or the first GPU")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    rounds, calls = (2, 300) if args.quick else (args.rounds, args.calls)
    medians: dict[str, list[float]] = {name: [] for name in CASES}
    for round_index in range(rounds):
        names = list(CASES) if round_index % 2 == 0 else list(reversed(CASES))
        for name in names:
            medians[name].append(median_call_seconds(CASES[name], calls, args.devices))
    base = sorted(medians["plain Keras"])[rounds // 2]
    print(f"eager Dense(64) call on a (8, 32) host array, {args.devices.upper()}; {rounds} rounds x {calls} calls, median per round\n")
    print(f"{'case':<22}{'median us':>11}{'ratio':>9}")
    for name, values in medians.items():
        median = sorted(values)[rounds // 2]
        print(f"{name:<22}{median * 1e6:>11.1f}{median / base:>9.3f}")
    print()
    for name, target in TARGETS.items():
        ratio = sorted(medians[name])[rounds // 2] / base
        status = "met" if ratio <= target else "missed"
        print(f'RESULT measure="eager layer(x) outside a strategy, {name} / plain Keras" '
              f"ratio={ratio:.3f} target=<={target:.2f} status={status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
