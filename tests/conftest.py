"""Shared fixtures: one embedded Ray cluster for the whole test session."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The raylet gives its agents this long to start (default about 15 s; a loaded CI machine needs more).
os.environ.setdefault("RAY_raylet_start_wait_time_s", "120")
# Ray exports ray.util.metrics every metrics_report_interval_ms (default 10 s; 1 s is its floor):
# the metrics tests scrape them during a short run.
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
# Ray Train's controller polls its workers every 2 s by default: a run's end (and a checkpoint's
# registration) is seen up to 2 s late, on every one of the suite's runs.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray kills idle task workers above num_workers_soft_limit (default: num_cpus, 4 here) while a
# run's ~9 actor processes live, so the next test's tokenise/sort tasks start fresh workers that
# re-import transformers: data prep measured 11.9 s after a training run vs 1.4 s with warm workers
# (a whole small run 44.7 s vs 35.8 s). Keep them.
os.environ.setdefault("RAY_num_workers_soft_limit", "32")

import pytest  # noqa: E402



@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray cluster shared by every test that needs one (started once, ~10 s)."""
    import ray

    from rapidfire_ray.driver.cluster import EMBEDDED_SYSTEM_CONFIG, worker_env

    # On a loaded machine a raylet can miss Ray's fixed 30 s start-up window: one more try.
    for attempt in range(2):
        if ray.is_initialized():
            break
        try:
            ray.init(num_cpus=4, log_to_driver=True,
                     runtime_env={"env_vars": worker_env()}, _system_config=EMBEDDED_SYSTEM_CONFIG,
                     _temp_dir=str(tmp_path_factory.mktemp("ray")) if sys.platform == "linux" else None)
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    yield ray
    ray.shutdown()
