"""A program without TensorFlow for `tfmp launch`'s restart tests.

Usage: restart_probe.py WORK_DIR MODE. Prints its restart count, clients and
devices. MODE `crash_once`: client 1 of the first run exits with status 3.
`usage`: exits with status 2. `preemptible`: writes WORK_DIR/started-<client>,
then waits; on SIGTERM it exits with status 143, as a preempted tfmp client does.
"""

import os
import signal
import sys
import time

work, mode = sys.argv[1], sys.argv[2]
client = os.environ.get("DTENSOR_CLIENT_ID", "0")
clients = len(os.environ["DTENSOR_JOBS"].split(",")) if "DTENSOR_JOBS" in os.environ else 1
print(f"restart {os.environ['TFMP_RESTART_COUNT']}: {clients} clients of {os.environ['TFMP_NUM_LOCAL_DEVICES']} devices", flush=True)
if mode == "crash_once" and os.environ["TFMP_RESTART_COUNT"] == "0" and client == "1":
    sys.exit(3)
if mode == "usage":
    sys.exit(2)
if mode == "preemptible":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    open(os.path.join(work, f"started-{client}"), "w").close()
    time.sleep(60)
