"""cluster/local/netns.py: N nodes in network namespaces joined by tc-shaped veth links (root only).

Each test brings up its own prefix (and subnet) and takes it down in a fixture, even on failure.
Numbers (measured bandwidth) are printed; run with `-s` to see them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from paths import REPO, load_script

NETNS_PY = os.path.join(REPO, "cluster", "local", "netns.py")


netns = load_script(NETNS_PY, "rapidfire_netns_harness")
_PID = os.getpid()


def _prefix(tag: str) -> str:
    return f"rf{tag}{_PID % 10000}"       # our own names: concurrent runs do not collide


def _subnet(k: int) -> str:
    return f"10.79.{(_PID + k) % 250}.0/24"


@pytest.fixture(scope="module", autouse=True)
def _needs_root_and_netns():
    reason = netns.preflight()            # root, ip/tc present, a namespace can be created
    if reason:
        pytest.skip(f"netns harness unavailable: {reason}")


@pytest.fixture
def harnesses():
    """Bring harnesses up through `make(...)`; every prefix is taken down afterwards, even on failure."""
    prefixes: list[str] = []
    made: list = []

    def make(tag: str, k: int, nodes: int = 2, bandwidth: str | None = "1gbit", delay: str | None = None):
        prefixes.append(_prefix(tag))
        h = netns.up(nodes, bandwidth, delay, prefix=_prefix(tag), subnet=_subnet(k))
        made.append(h)
        return h

    make.prefixes = prefixes
    try:
        yield make
    finally:
        errors = []
        for p in prefixes:
            try:
                netns.down(p)
            except (netns.HarnessError, OSError, subprocess.SubprocessError) as e:  # clean the others too
                errors.append(f"{p}: {e}")
        for h in made:
            for proc in h.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
        assert not errors, errors


def _leftovers(prefix: str) -> list[str]:
    """Anything of `prefix` still on the host: namespaces, links, state file."""
    names = [n for n in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else []) if n.startswith(prefix + "-")]
    links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True, text=True, check=True).stdout or "[]")
    names += [l["ifname"] for l in links if l["ifname"].startswith(prefix + "-")]
    names += [p for p in (netns.state_path(prefix), netns.state_path(prefix) + ".lock") if os.path.exists(p)]
    return names


def _pids_with(marker: str) -> list[int]:
    """Live (non-zombie) processes anywhere on the host whose command line contains `marker`."""
    return [int(p) for p in os.listdir("/proc")
            if p.isdigit() and marker in netns._proc_cmdline(int(p)) and netns._proc_starttime(int(p))]


# --- (a) bandwidth -------------------------------------------------------------------------------

ALLREDUCE = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
t = torch.ones(2 * 1024 * 1024)                      # 8 MiB of float32

def measure(n):
    dist.all_reduce(t); dist.barrier()               # warm-up: connections, buffers
    times = []
    for _ in range(n):
        t0 = time.perf_counter(); dist.all_reduce(t); times.append(time.perf_counter() - t0)
    med = sorted(times)[len(times) // 2]
    # 2 ranks: each sends 2(n-1)/n x 8 MiB = 8 MiB per allreduce (bus bandwidth = size / time)
    return {"bytes": t.numel() * 4, "times": times, "mbit_s": 8 * t.numel() * 4 / med / 1e6}

shaped = measure(3)
if rank == 0:
    print(json.dumps(shaped), flush=True)
    sys.stdin.readline()                             # the test removes the shaping meanwhile
dist.barrier()
unshaped = measure(5)
if rank == 0:
    print(json.dumps(unshaped), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_gloo_allreduce_between_namespaces_runs_at_the_shaped_bandwidth(harnesses, record_property, tmp_path):
    h = harnesses("a", 0, bandwidth="200mbit")
    qd = h.qdiscs()
    assert len(qd) == 4 and all("tbf" in v and "200Mbit" in v for v in qd.values()), qd   # both directions
    env = {**os.environ, **h.gloo_env, "MASTER_ADDR": h.ips[0], "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"}

    def err() -> str:
        return "".join((tmp_path / f"rank{r}.err").read_text()[-1500:] for r in (0, 1))

    with open(tmp_path / "rank0.err", "w") as log0, open(tmp_path / "rank1.err", "w") as log1:
        r1 = h.run(1, [sys.executable, "-c", ALLREDUCE, "1"], env=env, stdout=subprocess.DEVNULL, stderr=log1)
        r0 = h.run(0, [sys.executable, "-c", ALLREDUCE, "0"], env=env, stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, stderr=log0, text=True)
        line = r0.stdout.readline()
        assert line, err()
        shaped = json.loads(line)
        h.set_bandwidth(None)
        assert all("tbf" not in v for v in h.qdiscs().values())
        r0.stdin.write("go\n")
        r0.stdin.flush()
        unshaped = json.loads(r0.stdout.readline() or "null") or pytest.fail(err())
        assert r0.wait(timeout=60) == 0 and r1.wait(timeout=60) == 0, err()
    print(f"\n8 MiB gloo allreduce, 2 namespaces: shaped 200mbit -> {shaped['mbit_s']:.0f} Mbit/s "
          f"(times {[round(x, 3) for x in shaped['times']]}); unshaped -> {unshaped['mbit_s']:.0f} Mbit/s "
          f"(times {[round(x, 4) for x in unshaped['times']]})")
    record_property("shaped_mbit_s", round(shaped["mbit_s"], 1))
    record_property("unshaped_mbit_s", round(unshaped["mbit_s"], 1))
    assert 100 <= shaped["mbit_s"] <= 300, shaped                 # within 0.5x-1.5x of the limit
    assert unshaped["mbit_s"] > 3 * shaped["mbit_s"], (shaped, unshaped)


# --- (b) Ray -------------------------------------------------------------------------------------

DRIVER = r"""
import json, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR")
deadline = time.time() + 30
while True:
    nodes = [(n["NodeManagerAddress"], n["Alive"]) for n in ray.nodes()]
    if sum(alive for _, alive in nodes) >= 2 or time.time() > deadline:
        break
    time.sleep(0.5)
print(json.dumps(nodes))
"""


@pytest.mark.timeout(120)
def test_ray_head_and_worker_in_two_namespaces(harnesses):
    h = harnesses("b", 1)
    temp_root = tempfile.mkdtemp(prefix="rfnr-", dir="/tmp")     # short: Ray's unix sockets live here
    try:
        t0 = time.monotonic()
        address = netns.start_ray(h, temp_root)
        started = time.monotonic() - t0
        assert address == f"{h.ips[0]}:6379"
        proc = h.exec(0, [sys.executable, "-c", DRIVER, address], env=netns.ray_env(),
                      capture_output=True, text=True, timeout=90, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        nodes = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"\nray: 2 nodes started in {started:.1f} s; ray.nodes() from a driver in {h.ns_names[0]}: {nodes}")
        assert sorted(ip for ip, alive in nodes if alive) == sorted(h.ips)
        t1 = time.monotonic()
        stopped = netns.stop_ray(h)
        print(f"ray: stopped {len(stopped)} processes by PID in {time.monotonic() - t1:.1f} s")
        assert stopped and not h.pids()
        assert not _pids_with(temp_root)
    finally:
        netns.stop_ray(h)
        shutil.rmtree(temp_root, ignore_errors=True)


# --- (c) down ------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_down_removes_namespaces_links_state_and_processes(harnesses):
    h = harnesses("c", 2)
    prefix = h.prefix
    assert os.path.exists(h.state_path) and len(_leftovers(prefix)) >= 5
    recorded = h.run(1, ["sleep", "300"])
    # a process started in a namespace without the helper is found by its namespace, not a record
    unrecorded = subprocess.Popen(["ip", "netns", "exec", h.ns_names[0], "sleep", "301"])
    try:
        time.sleep(0.3)
        assert set(h.pids()) == {recorded.pid, unrecorded.pid}
        result = netns.down(prefix)
        assert {recorded.pid, unrecorded.pid} <= set(result["pids"]) and result["state"]
        assert recorded.wait(timeout=10) is not None and unrecorded.wait(timeout=10) is not None
        assert _leftovers(prefix) == []
        assert netns.down(prefix) == {"pids": [], "namespaces": [], "links": [], "state": False}   # idempotent
    finally:
        for p in (recorded, unrecorded):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("crash_after", ["state", "ns:1", "veth:1", "shape:0"])
def test_down_after_a_partial_up(harnesses, crash_after):
    prefix = _prefix("p")
    harnesses.prefixes.append(prefix)                                  # the fixture downs it regardless
    cli = [sys.executable, NETNS_PY]
    proc = subprocess.run(cli + ["up", "--nodes", "3", "--bandwidth", "100mbit", "--prefix", prefix,
                                 "--subnet", _subnet(3)],
                          env={**os.environ, netns.CRASH_ENV: crash_after}, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 97, proc.stderr                           # "crashed" mid-up, no rollback
    assert os.path.exists(netns.state_path(prefix))
    proc = subprocess.run(cli + ["down", "--prefix", prefix], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("down: stopped"), proc.stderr
    assert _leftovers(prefix) == []
    proc = subprocess.run(cli + ["down", "--prefix", prefix], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0 and "nothing" in proc.stdout


# --- delay needs netem ---------------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_delay_needs_netem_and_never_is_ignored(harnesses):
    prefix = _prefix("d")
    harnesses.prefixes.append(prefix)
    have_netem = netns.netem_available()
    proc = subprocess.run([sys.executable, NETNS_PY, "up", "--nodes", "2", "--bandwidth", "100mbit",
                           "--delay", "1ms", "--prefix", prefix, "--subnet", _subnet(4)],
                          capture_output=True, text=True, timeout=30, check=False)
    if have_netem:
        assert proc.returncode == 0, proc.stderr
        h = netns.load(prefix)
        ns_side = [v for k, v in h.qdiscs().items() if ":" in k]
        assert all("netem" in v and "delay 1ms" in v and "tbf" in v for v in ns_side), ns_side
    else:
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("netns: error: --delay needs the netem qdisc"), lines
        assert _leftovers(prefix) == []                               # nothing was created
