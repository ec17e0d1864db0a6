"""Every cluster definition validates offline against Ray's autoscaler schema, and keeps the
project's secure defaults (token auth on, dashboard never on 0.0.0.0)."""
from __future__ import annotations

import copy
import glob
import os
import re

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = [os.path.join(REPO, "ray_cluster.yaml"), *sorted(glob.glob(os.path.join(REPO, "cluster", "*.yaml")))]
CLOUD = {"ray_cluster.yaml", "gcp_a100.yaml", "onprem.yaml"}


def _load(path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _prepared(cfg):
    """What Ray's launcher/autoscaler validates for this file, without touching any cloud."""
    from ray.autoscaler._private.util import prepare_config

    if cfg["provider"]["type"] == "fake_multinode":
        # The head's autoscaler reads a fake_multinode file as it is (no defaults merged: the
        # defaults file, fake_multi_node/example.yaml, is not in the Ray 2.60 wheel), so the file
        # itself must be complete.
        return copy.deepcopy(cfg)
    return prepare_config(copy.deepcopy(cfg))


def _validate(cfg):
    from ray.autoscaler._private.util import validate_config

    validate_config(_prepared(cfg))  # raises on a schema violation


def test_the_expected_cluster_files_exist():
    names = {os.path.basename(p) for p in FILES}
    assert names >= CLOUD | {"local_fake.yaml"}, names


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_cluster_file_is_valid_for_ray(path):
    _validate(_load(path))


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_cluster_file_keeps_secure_defaults(path):
    cfg = _prepared(_load(path))
    for cmd in cfg.get("head_start_ray_commands", []) + cfg.get("worker_start_ray_commands", []):
        assert "0.0.0.0" not in cmd, cmd
    if os.path.basename(path) not in CLOUD:
        return
    heads = [c for c in cfg["head_start_ray_commands"] if "ray start --head" in c]
    workers = [c for c in cfg["worker_start_ray_commands"] if "ray start --address" in c]
    assert heads and workers
    for cmd in heads:
        assert "--dashboard-host=127.0.0.1" in cmd, cmd
    for cmd in heads + workers:
        # Token auth on at every `ray start` (Ray 2.60 reads it from the environment only).
        assert re.search(r"\bRAY_AUTH_MODE=token\b", cmd), cmd
    # The token every node needs is synced from the launching machine.
    assert cfg["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"


@pytest.mark.parametrize("path", [p for p in FILES if os.path.basename(p) in {"ray_cluster.yaml", "gcp_a100.yaml"}],
                         ids=os.path.basename)
def test_gpu_worker_types_request_scale_up_and_offer_spot(path):
    cfg = _load(path)
    types = cfg["available_node_types"]
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert len(workers) >= 2
    for name, t in workers.items():
        assert t["resources"].get("GPU") == 8 and t["resources"].get("a100") == 8, name
        assert t.get("min_workers", 0) == 0 and t["max_workers"] >= 1, name
    assert types[cfg["head_node_type"]]["resources"].get("GPU", 0) == 0
    spot = [t["node_config"] for t in workers.values()
            if t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot"
            or t["node_config"].get("scheduling", {}).get("provisioningModel") == "SPOT"]
    assert len(spot) == 1 and len(workers) - len(spot) >= 1
    assert cfg["idle_timeout_minutes"] > 0


@pytest.mark.parametrize("path", [p for p in FILES if os.path.basename(p) in {"ray_cluster.yaml", "gcp_a100.yaml"}],
                         ids=os.path.basename)
def test_a_gpu_run_scales_spot_first_then_on_demand(path):
    """Ray's own (v1) resource-demand scheduler, fed the file's node types and a run's worker
    bundles ({GPU: 1, CPU: 1} each), adds spot nodes first and on-demand ones past spot's bound."""
    import functools

    from ray.autoscaler._private.node_provider_availability_tracker import NodeAvailabilitySummary
    from ray.autoscaler._private.resource_demand_scheduler import _default_utilization_scorer, get_nodes_for

    cfg = _load(path)
    types = cfg["available_node_types"]
    scorer = functools.partial(_default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({}))

    def plan(gpus):
        added, unplaced = get_nodes_for(types, {}, cfg["head_node_type"], cfg["max_workers"],
                                        [{"GPU": 1, "CPU": 1}] * gpus, utilization_scorer=scorer)
        return dict(added), len(unplaced)

    assert plan(16) == ({"a100x8_spot": 2}, 0)
    spot_max = types["a100x8_spot"]["max_workers"]
    added, _ = plan(8 * (spot_max + 1))
    assert added == {"a100x8_spot": spot_max, "a100x8_ondemand": 1}


def test_aws_workers_use_efa_and_nccl_settings():
    cfg = _load(FILES[0])
    for name, t in cfg["available_node_types"].items():
        if name == cfg["head_node_type"]:
            continue
        assert t["node_config"]["InstanceType"] == "p4d.24xlarge"
        nics = t["node_config"]["NetworkInterfaces"]
        assert [n["NetworkCardIndex"] for n in nics] == [0, 1, 2, 3]
        assert all(n["InterfaceType"] == "efa" for n in nics)
    start = " ".join(cfg["worker_start_ray_commands"])
    for setting in ("FI_PROVIDER=efa", "FI_EFA_USE_DEVICE_RDMA=1", "NCCL_SOCKET_IFNAME=", "/opt/amazon/ofi-nccl/lib"):
        assert setting in start, setting


def test_local_fake_cluster_offers_a_custom_accelerator_to_scale_up():
    cfg = _load(os.path.join(REPO, "cluster", "local_fake.yaml"))
    assert cfg["provider"]["type"] == "fake_multinode"
    assert cfg["head_node_type"] == "ray.head.default"  # the name Ray's fake provider gives its head
    head = cfg["available_node_types"]["ray.head.default"]
    assert "accelerator" not in head["resources"]
    offering = [t for k, t in cfg["available_node_types"].items()
                if t["resources"].get("accelerator", 0) > 0 and t.get("max_workers", 0) > 0]
    assert offering and all(t.get("min_workers", 0) == 0 for t in offering)


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_a_broken_cluster_file_is_rejected(path):
    cfg = _load(path)
    broken = [copy.deepcopy(cfg) for _ in range(3)]
    broken[0]["max_workers"] = "many"
    broken[1]["no_such_field"] = 1
    broken[2].pop("provider")
    for b in broken:
        with pytest.raises(Exception):
            _validate(b)
    if cfg.get("available_node_types"):
        b = copy.deepcopy(cfg)
        name = next(iter(b["available_node_types"]))
        b["available_node_types"][name]["resources"] = {"CPU": -1}
        with pytest.raises(Exception):
            _validate(b)
