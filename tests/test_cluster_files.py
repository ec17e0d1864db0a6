"""Every cluster definition validates offline against Ray's autoscaler schema."""
from __future__ import annotations

import glob
import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(REPO, "ray_cluster.yaml"), *sorted(glob.glob(os.path.join(REPO, "cluster", "*.yaml")))]


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_cluster_file_is_valid_for_ray(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    with open(path, encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    validate_config(prepare_config(cfg))  # raises on a schema violation
    for cmd in cfg.get("head_start_ray_commands", []):
        if "ray start --head" in cmd:
            assert "--dashboard-host=0.0.0.0" not in cmd


def test_a_broken_cluster_file_is_rejected():
    from ray.autoscaler._private.util import prepare_config, validate_config

    with open(FILES[0], encoding="utf-8") as f:
        cfg = yaml.safe_load(f)
    cfg["max_workers"] = "many"
    with pytest.raises(Exception):
        validate_config(prepare_config(cfg))
