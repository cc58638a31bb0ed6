"""Splits the host CPU into 8 logical devices once for the whole test session."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfmp  # noqa: E402

tfmp.simulate_devices(8)
