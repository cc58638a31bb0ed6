"""Joins a multi-client run and exits: `join.py TIMEOUT_S`."""

import sys

import tfmp

cluster = tfmp.initialize(timeout_s=float(sys.argv[1]))
print(f"joined as client {cluster.client_id} of {cluster.num_clients} with {cluster.local_devices} devices")
