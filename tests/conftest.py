"""Shared fixtures: one embedded Ray cluster for the whole test session."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray exports ray.util.metrics every metrics_report_interval_ms (default 10 s; 1 s is its floor):
# the metrics tests scrape them during a short run.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")

import pytest  # noqa: E402



@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster shared by every test that needs one (started once, ~10 s)."""
    import ray

    from rapidfire_ray.launcher import WORKER_ENV

    if not ray.is_initialized():
        ray.init(num_cpus=4, log_to_driver=True,
                 runtime_env={"env_vars": WORKER_ENV},
                 _temp_dir=str(tmp_path_factory.mktemp("ray")) if sys.platform == "linux" else None)
    yield ray
    ray.shutdown()
