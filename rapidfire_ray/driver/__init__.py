"""The driver: one `run` for a single stage, `run_pipeline` for SFT -> reward -> RL."""
from __future__ import annotations

import os

# Set before Ray is imported. Ray Train V2 patches print() in workers; with `datasets`
# fingerprinting it floods the logs.
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
# An embedded cluster's raylet gives its agents this long to start (Ray's default, about 15 s, is
# too short on a busy small machine: the raylet then aborts and ray.init fails).
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")

from .pipeline import run_pipeline  # noqa: E402
from .run import run  # noqa: E402

__all__ = ["run", "run_pipeline"]
