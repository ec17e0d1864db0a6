"""Workers' resource requests: a visible wait while the cluster cannot place them, a one-line
timeout, and a fake-autoscaling head that adds a node for them and removes it when idle."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import yaml

from private_head import PrivateHead

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "jobs", "configs", "tiny.yaml")


def test_wait_then_one_line_timeout_for_a_resource_no_node_has(ray_cluster, tmp_path, capsys):
    from rapidfire_ray.config import load_config
    from rapidfire_ray.errors import RapidfireError
    from rapidfire_ray.driver import run

    cfg = load_config(TINY, {"run.output_dir": str(tmp_path), "scaling.resources_per_worker": {"a100_80g": 1},
                             "scaling.placement_timeout_s": 7, "train.max_steps": 1})
    start = time.monotonic()
    with pytest.raises(RapidfireError) as err:
        run(cfg)
    took = time.monotonic() - start
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("scaling.placement_timeout_s: the cluster could not place 2 x {CPU: 1, a100_80g: 1} "
                          "(PACK) within 7 s; cluster has 1 node(s), total {CPU: 4}"), msg
    out = capsys.readouterr().out
    waits = re.findall(r"\[rapidfire\] waiting for 2 x \{CPU: 1, a100_80g: 1\} \(PACK\) to be placed: (\d+) s of 7 s "
                       r"\(cluster has 1 node\(s\), total \{CPU: 4\}, free \{CPU: \d+\}\)", out)
    assert len(waits) >= 1 and int(waits[0]) <= 3, out
    assert took < 120
    # The reservation was released: the cluster's CPUs are free again (no run, no leftover group).
    import ray
    from ray.util import placement_group_table

    assert not [p for p in placement_group_table().values()
                if p["name"].startswith("rapidfire-placement-check") and p["state"] != "REMOVED"]
    assert ray.available_resources().get("CPU") == 4


def test_placement_waits_visibly_until_a_node_joins(ray_cluster, capsys):
    """The wait returns once the cluster can hold the group (here: a resource that frees up)."""
    import ray

    from rapidfire_ray.driver.cluster import wait_for_workers

    @ray.remote(num_cpus=3)
    class Hog:
        def ping(self):
            return 1

    hog = Hog.remote()
    ray.get(hog.ping.remote())
    lines = []
    import threading

    threading.Timer(4.0, lambda: ray.kill(hog)).start()
    waited = wait_for_workers({"CPU": 2}, 1, "PACK", 60, lines.append, every_s=1.0)
    assert 3.0 <= waited < 30, (waited, lines)
    assert any(ln.startswith("waiting for 1 x {CPU: 2} (PACK) to be placed") for ln in lines), lines
    assert lines[-1].startswith("workers placed after"), lines


def _monitor_events(head: PrivateHead) -> list[tuple[float, str]]:
    """(time, line) of the autoscaler's launch/terminate decisions from its monitor log."""
    events = []
    for root, _dirs, files in os.walk(os.path.join(head.temp, "ray")):
        for name in files:
            if name.startswith("monitor") and name.endswith(".log"):
                with open(os.path.join(root, name), errors="replace") as f:
                    for line in f:
                        m = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
                        if m and re.search(r"Adding \d+ node|Removing \d+ node", line):
                            t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1e3
                            events.append((t, line.strip()))
    return sorted(events)


def _active_node_types(head: PrivateHead) -> str:
    proc = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status", "--address", head.address],
                          env=head.env, capture_output=True, text=True, timeout=60)
    active = proc.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return active


@pytest.mark.slow
def test_fake_autoscaler_adds_a_node_for_the_workers_and_removes_it_when_idle(tmp_path):
    """Ray's fake_multinode provider (cluster/local_fake.yaml, with this head's port and a short
    idle timeout): the run's worker asks for {accelerator: 1}, which only the accel_node type has;
    the autoscaler adds one, the run waits visibly, trains, and the idle node is removed."""
    with open(os.path.join(REPO, "cluster", "local_fake.yaml")) as f:
        cluster = yaml.safe_load(f)
    head = PrivateHead(num_cpus=2, extra_env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
    cluster["provider"]["gcs_address"] = head.address
    cluster["available_node_types"]["ray.head.default"]["resources"]["CPU"] = 2  # tokenising fits on the head
    cluster["idle_timeout_minutes"] = 0.25
    config = tmp_path / "fake.yaml"
    config.write_text(yaml.safe_dump(cluster))
    head.autoscaling_config = str(config)
    with head:
        assert "accel_node" not in _active_node_types(head)
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "rapidfire_ray", "train", "--profile", TINY, "--address",
                               head.address, f"run.output_dir={tmp_path}", "train.max_steps=2",
                               "checkpoint.every_steps=0", "scaling.num_workers=1",
                               "scaling.resources_per_worker={accelerator: 1}", "scaling.placement_timeout_s=240"],
                              env=head.env, capture_output=True, text=True, timeout=600, cwd=REPO)
        t_done = time.time()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        # The worker's request scales an accel_node up. (Ray Data's own CPU requests during tokenising
        # may have added one already, then the driver finds it placed at once; else it waits visibly.)
        waited = re.search(r"\[rapidfire\] waiting for 1 x \{CPU: 1, accelerator: 1\} \(PACK\) to be placed: \d+ s "
                           r"of 240 s \(cluster has \d node\(s\), total \{CPU: \d\}", proc.stdout)
        placed = re.search(r"workers placed after (\d+) s", proc.stdout)
        assert bool(waited) == bool(placed), proc.stdout[-3000:]
        summary = json.loads((tmp_path / "tiny" / "run_summary.json").read_text())
        assert summary["steps"] == 2
        # Scale-down: the idle accel_node goes (idle timeout 6 s, autoscaler every 1 s).
        deadline = time.time() + 180
        while "accel_node" in _active_node_types(head) and time.time() < deadline:
            time.sleep(2)
        t_gone = time.time()
        assert "accel_node" not in _active_node_types(head)
        events = _monitor_events(head)
        added = [t for t, line in events if "Adding 1 node(s) of type accel_node" in line]
        assert added, events
        print(f"\nfake autoscaler: run start -> first node added {added[0] - t0:.1f} s, driver waited "
              f"{placed.group(1) + ' s' if placed else 'not at all'} for the workers, run finished {t_done - t0:.1f} s, "
              f"node gone {t_gone - t_done:.1f} s after the run; monitor: {[ln[-80:] for _, ln in events]}")
