#!/usr/bin/env python3
"""Local multi-node harness: N "nodes" in Linux network namespaces on one host, joined by a bridge,
with the links shaped by `tc` (bandwidth with `tbf`, optional latency with `netem`).

    python cluster/local/netns.py up --nodes 2 --bandwidth 100mbit [--delay 1ms] [--prefix rf]
    python cluster/local/netns.py status [--prefix rf]
    python cluster/local/netns.py down [--prefix rf]

Topology (prefix `rf`, default subnet 10.77.0.0/24):

    host:  bridge rf-br0 (10.77.0.254/24) -- rf-v0 ... rf-v{N-1}   (host ends of the veth pairs)
    ns i:  netns rf-n{i}: lo up, `eth0` = 10.77.0.{i+1}/24           (same name in every namespace,
                                                                     so GLOO_SOCKET_IFNAME=eth0)

Shaping: a `tbf` qdisc at the given rate on both ends of every veth (egress of rf-v{i} = traffic
into node i, egress of eth0 in rf-n{i} = traffic out of node i), so node-to-node traffic meets the
limit in each direction. `burst` = max(64 KiB, 1 ms at the rate) (one 64 KiB GSO frame fits whole
and the token bucket refills at timer resolution without starving the link); `latency 50ms` caps
the queue at the rate x 50 ms + burst (deep enough for TCP to fill the link at LAN round trips).
`--delay D` adds `netem delay D` on the namespace end only, so every node-to-node packet is delayed
once: one-way delay D, round trip 2D. The kernel needs the netem qdisc (CONFIG_NET_SCH_NETEM); when
it lacks it, `up --delay` fails with one line and creates nothing. (The netem layout, netem root with
the tbf as its child, is the one netem's documentation gives; it was not run on the development VM,
whose kernel has no sch_netem.)

Everything `up` creates is listed in a state file (/run/rapidfire-netns-<prefix>.json) *before* it
is created, so `down` removes exactly that (plus anything named by the prefix's exact patterns)
even after a crashed or partial `up`; `down` is idempotent. Processes are stopped by PID only:
those recorded by `Harness.run`/`start_ray` (checked against their start time) and any process
whose network namespace is one of ours. Nothing else on the host is touched (no `ray stop`, which
stops every Ray process on the machine).

Needs root, `ip` and `tc` (iproute2).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self

DEFAULT_PREFIX = "rf"
DEFAULT_SUBNET = "10.77.0.0/24"
IFNAME = "eth0"                      # the veth end inside every namespace
STATE_DIR = os.environ.get("RAPIDFIRE_NETNS_STATE_DIR", "/run")
TBF_LATENCY = "50ms"
MIN_BURST = 64 * 1024
RAY_PORT = 6379
# Test hook: `up` calls os._exit(97) right after the named step ("state", "bridge", "ns:1",
# "veth:1", "shape:1"), as if it had crashed there (no rollback, no finally).
CRASH_ENV = "RAPIDFIRE_NETNS_CRASH_AFTER"

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,7}$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$")
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}
_TIME_RE = re.compile(r"^\d+(?:\.\d+)?(us|usec|ms|msec|s|sec)$")


class HarnessError(RuntimeError):
    """A one-line, user-facing failure."""


# ----------------------------------------------------------------------------- small helpers

def _sh(argv: list[str], check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        msg = (proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}").splitlines()[0]
        raise HarnessError(f"`{' '.join(argv)}` failed: {msg}")
    return proc


def parse_rate(rate: str | None) -> int | None:
    """'100mbit' -> 100_000_000 (bits/s); None/'none'/'0' -> None (unshaped). tc's units."""
    if rate is None or str(rate).lower() in ("none", "0", ""):
        return None
    m = _RATE_RE.match(str(rate).strip().lower())
    if not m:
        raise HarnessError(f"bad bandwidth {rate!r}: use tc units, e.g. 100mbit, 1gbit, 500kbit, 10mbps")
    bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if bits < 8000:
        raise HarnessError(f"bandwidth {rate!r} is too small (at least 8kbit)")
    return bits


def parse_delay(delay: str | None) -> str | None:
    if delay is None or str(delay).lower() in ("none", "0", ""):
        return None
    if not _TIME_RE.match(str(delay).strip().lower()):
        raise HarnessError(f"bad delay {delay!r}: use tc time units, e.g. 1ms, 500us")
    return str(delay).strip().lower()


def tbf_params(bits_per_s: int) -> dict:
    """Burst and queue settings for a tbf at this rate (see the module docstring)."""
    burst = max(MIN_BURST, bits_per_s // 8 // 1000)
    return {"rate": f"{bits_per_s}bit", "burst": str(burst), "latency": TBF_LATENCY}


def state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"rapidfire-netns-{prefix}.json")


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix or ""):
        raise HarnessError(f"bad prefix {prefix!r}: 1-8 characters, a-z then a-z/0-9 (interface names are "
                           "limited to 15 characters)")


def _proc_starttime(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] == "Z":          # a zombie is gone for our purposes
        return None
    return int(fields[19])


def _proc_ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _proc_cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ns_inode(ns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return None


def pids_in_namespaces(ns_names: list[str]) -> list[int]:
    """Live processes whose network namespace is one of `ns_names` (by nsfs inode; ours only)."""
    wanted = {f"net:[{ino}]" for ino in (_ns_inode(n) for n in ns_names) if ino is not None}
    if not wanted:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") in wanted and _proc_starttime(int(entry)) is not None:
                    pids.append(int(entry))
            except OSError:
                pass
    return sorted(pids)


def _alive(pid: int, starttime: int | None) -> bool:
    """Whether `pid` is still the very process we saw (same start time); never guesses without one."""
    return starttime is not None and _proc_starttime(pid) == starttime


def kill_pids(procs: list[tuple[int, int | None]], grace: float = 2.0) -> list[int]:
    """SIGTERM, then SIGKILL after `grace` s, each (pid, starttime) that is still that same process."""
    targets = [(p, st) for p, st in procs if p != os.getpid() and _alive(p, st)]
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid, st in targets:
            if _alive(pid, st):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p, st) for p, st in targets):
            time.sleep(0.1)
    return [p for p, _ in targets]


def netem_available() -> bool | None:
    """Whether tc knows the netem qdisc, probed on a throwaway link; None if that cannot be tried."""
    probe = f"rfnq{os.getpid() % 100000}"
    if _sh(["ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "p"], check=False).returncode:
        return None
    try:
        return _sh(["tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms"], check=False).returncode == 0
    finally:
        _sh(["ip", "link", "del", probe], check=False)


def preflight() -> str | None:
    """None if the harness can run here, else the reason it cannot (for skips and errors)."""
    if os.geteuid() != 0:
        return "the netns harness needs root (ip netns, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"rfprobe{os.getpid() % 100000}"
    proc = _sh(["ip", "netns", "add", probe], check=False)
    if proc.returncode:
        return f"cannot create network namespaces here: {proc.stderr.strip()}"
    _sh(["ip", "netns", "del", probe], check=False)
    return None


# ----------------------------------------------------------------------------- state file

@contextlib.contextmanager
def _locked_state(prefix: str):
    """Read-modify-write the state file under an exclusive lock; yields a dict (None if absent)."""
    path = state_path(prefix)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        box = {"state": None}
        if os.path.exists(path):
            with open(path) as f:
                box["state"] = json.load(f)
        yield box
        if box["state"] is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(box["state"], f, indent=1)
            os.replace(tmp, path)
    with contextlib.suppress(FileNotFoundError):
        if not os.path.exists(path):
            os.unlink(path + ".lock")


def read_state(prefix: str) -> dict | None:
    try:
        with open(state_path(prefix)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _record_pids(prefix: str, key: str, procs: list[tuple[int, int | None, str]]) -> None:
    with _locked_state(prefix) as box:
        if box["state"] is not None:
            box["state"].setdefault(key, []).extend(
                {"pid": p, "starttime": st, "what": what} for p, st, what in procs)


# ----------------------------------------------------------------------------- the harness

@dataclass
class Harness:
    prefix: str
    ns_names: list[str]
    ips: list[str]
    bridge: str
    bridge_ip: str
    host_links: list[str]
    ifname: str = IFNAME
    bandwidth: str | None = None
    delay: str | None = None
    ray_address: str | None = None
    procs: list = field(default_factory=list, repr=False)

    @property
    def state_path(self) -> str:
        return state_path(self.prefix)

    @property
    def gloo_env(self) -> dict:
        """Env for gloo/NCCL-socket processes inside the namespaces (the veth has the same name in each)."""
        return {"GLOO_SOCKET_IFNAME": self.ifname, "NCCL_SOCKET_IFNAME": self.ifname}

    def netns_argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns_names[i], *argv]

    def run(self, i: int, argv: list[str], **popen_kw) -> subprocess.Popen:
        """Start `argv` inside namespace i (via `ip netns exec`, which keeps the environment).
        The PID is recorded in the state file, so `down` stops it even if the caller forgets."""
        proc = subprocess.Popen(self.netns_argv(i, argv), **popen_kw)
        self.procs.append(proc)
        start = _proc_starttime(proc.pid)     # `ip netns exec` execs argv: same PID, same start time
        if start is not None:
            _record_pids(self.prefix, "pids", [(proc.pid, start, " ".join(argv)[:200])])
        return proc

    def exec(self, i: int, argv: list[str], **run_kw) -> subprocess.CompletedProcess:
        """Run `argv` inside namespace i to completion (subprocess.run keywords)."""
        return subprocess.run(self.netns_argv(i, argv), check=run_kw.pop("check", False), **run_kw)

    def pids(self) -> list[int]:
        """Every live process inside our namespaces."""
        return pids_in_namespaces(self.ns_names)

    def set_bandwidth(self, bandwidth: str | None) -> None:
        """Re-shape every link at `bandwidth` (None: unshaped); the delay, if any, stays."""
        bits = parse_rate(bandwidth)
        for i, ns in enumerate(self.ns_names):
            _shape(self.host_links[i], None, bits, None)
            _shape(self.ifname, ns, bits, self.delay)
        self.bandwidth = None if bits is None else bandwidth
        with _locked_state(self.prefix) as box:
            if box["state"] is not None:
                box["state"]["bandwidth"] = self.bandwidth

    def qdiscs(self) -> dict[str, str]:
        out = {}
        for i, ns in enumerate(self.ns_names):
            out[self.host_links[i]] = _sh(["tc", "qdisc", "show", "dev", self.host_links[i]], check=False).stdout.strip()
            out[f"{ns}:{self.ifname}"] = _sh(["tc", "-n", ns, "qdisc", "show", "dev", self.ifname],
                                             check=False).stdout.strip()
        return out

    def down(self) -> dict:
        result = down(self.prefix)
        for p in self.procs:          # reap the processes we started (they are dead by now)
            with contextlib.suppress(Exception):
                p.wait(timeout=5)
        return result

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.down()


def _names(prefix: str, nodes: int, subnet: str) -> dict:
    net = ipaddress.ip_network(subnet)
    hosts = list(net.hosts())
    if nodes < 1 or nodes > len(hosts) - 1:
        raise HarnessError(f"--nodes must be 1..{len(hosts) - 1} for subnet {subnet}")
    return {
        "prefix": prefix,
        "subnet": str(net),
        "prefixlen": net.prefixlen,
        "namespaces": [f"{prefix}-n{i}" for i in range(nodes)],
        "host_links": [f"{prefix}-v{i}" for i in range(nodes)],
        "peer_links": [f"{prefix}-p{i}" for i in range(nodes)],   # the ns end's name before it moves
        "bridge": f"{prefix}-br0",
        "bridge_ip": str(hosts[-1]),
        "ips": [str(hosts[i]) for i in range(nodes)],
    }


def _shape(dev: str, ns: str | None, bits: int | None, delay: str | None) -> None:
    tc = ["tc"] + (["-n", ns] if ns else [])
    _sh(tc + ["qdisc", "del", "dev", dev, "root"], check=False)    # back to the default qdisc
    tbf = tbf_params(bits) if bits else None
    tbf_args = ["tbf", "rate", tbf["rate"], "burst", tbf["burst"], "latency", tbf["latency"]] if tbf else []
    if delay:
        # netem as root, tbf as its child: the layout netem's documentation gives for delay + rate.
        proc = _sh(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", delay,
                         "limit", "100000"], check=False)
        if proc.returncode:
            raise HarnessError(_netem_message(proc.stderr))
        if tbf:
            _sh(tc + ["qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf_args])
    elif tbf:
        _sh(tc + ["qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf_args])


def _netem_message(stderr: str) -> str:
    why = (stderr.strip().splitlines() or ["unknown error"])[0]
    return (f"--delay needs the netem qdisc (kernel option CONFIG_NET_SCH_NETEM), which this kernel "
            f"does not offer (tc: {why}); run without --delay, or on a kernel with sch_netem")


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        sys.stdout.flush()
        os._exit(97)


def _check_subnet_free(subnet: str) -> None:
    net = ipaddress.ip_network(subnet)
    out = _sh(["ip", "-j", "-4", "addr", "show"]).stdout
    for link in json.loads(out or "[]"):
        for a in link.get("addr_info", []):
            iface = ipaddress.ip_interface(f"{a['local']}/{a['prefixlen']}")
            if iface.network.overlaps(net):
                raise HarnessError(f"subnet {subnet} overlaps {iface} on {link.get('ifname')}; "
                                   "pick another with --subnet")


def up(nodes: int, bandwidth: str | None, delay: str | None = None, prefix: str = DEFAULT_PREFIX,
       subnet: str = DEFAULT_SUBNET) -> Harness:
    """Create `nodes` namespaces joined by a shaped bridge; returns the Harness. On any failure,
    everything made so far is removed again and HarnessError is raised."""
    _check_prefix(prefix)
    bits = parse_rate(bandwidth)
    delay = parse_delay(delay)
    reason = preflight()
    if reason:
        raise HarnessError(reason)
    names = _names(prefix, nodes, subnet)
    if read_state(prefix) is not None:
        raise HarnessError(f"prefix {prefix!r} is already up ({state_path(prefix)}); "
                           f"run `down --prefix {prefix}` first")
    existing = _existing(prefix)
    if existing["namespaces"] or existing["links"]:
        raise HarnessError(f"leftovers of prefix {prefix!r} exist ({', '.join(existing['namespaces'] + existing['links'])}); "
                           f"run `down --prefix {prefix}` first")
    _check_subnet_free(subnet)
    if delay and netem_available() is False:
        raise HarnessError(_netem_message("Specified qdisc kind is unknown."))

    # The state file names everything before any of it exists: a crash anywhere below leaves
    # nothing that `down` does not know about.
    with _locked_state(prefix) as box:
        box["state"] = {**names, "nodes": nodes, "bandwidth": bandwidth if bits else None, "delay": delay,
                        "ifname": IFNAME, "created": time.time(), "pids": [], "ray": []}
    _crash_point("state")
    try:
        br = names["bridge"]
        _sh(["ip", "link", "add", br, "type", "bridge"])
        _sh(["ip", "addr", "add", f"{names['bridge_ip']}/{names['prefixlen']}", "dev", br])
        _sh(["ip", "link", "set", br, "up"])
        _crash_point("bridge")
        for i in range(nodes):
            ns, host, peer, ip = names["namespaces"][i], names["host_links"][i], names["peer_links"][i], names["ips"][i]
            _sh(["ip", "netns", "add", ns])
            _sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            _crash_point(f"ns:{i}")
            _sh(["ip", "link", "add", host, "type", "veth", "peer", "name", peer])
            _sh(["ip", "link", "set", peer, "netns", ns])
            _sh(["ip", "-n", ns, "link", "set", peer, "name", IFNAME])
            _sh(["ip", "-n", ns, "addr", "add", f"{ip}/{names['prefixlen']}", "dev", IFNAME])
            _sh(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            _sh(["ip", "link", "set", host, "master", br])
            _sh(["ip", "link", "set", host, "up"])
            _crash_point(f"veth:{i}")
            _shape(host, None, bits, None)
            _shape(IFNAME, ns, bits, delay)
            _crash_point(f"shape:{i}")
    except BaseException:
        down(prefix)
        raise
    return Harness(prefix=prefix, ns_names=names["namespaces"], ips=names["ips"], bridge=names["bridge"],
                   bridge_ip=names["bridge_ip"], host_links=names["host_links"], ifname=IFNAME,
                   bandwidth=bandwidth if bits else None, delay=delay)


def load(prefix: str = DEFAULT_PREFIX) -> Harness:
    """The Harness of a prefix that is up (from its state file)."""
    st = read_state(prefix)
    if st is None:
        raise HarnessError(f"prefix {prefix!r} is not up (no {state_path(prefix)})")
    ray = st.get("ray") or []
    return Harness(prefix=prefix, ns_names=st["namespaces"], ips=st["ips"], bridge=st["bridge"],
                   bridge_ip=st["bridge_ip"], host_links=st["host_links"], ifname=st.get("ifname", IFNAME),
                   bandwidth=st.get("bandwidth"), delay=st.get("delay"),
                   ray_address=ray[0].get("address") if ray else None)


def _existing(prefix: str, state: dict | None = None) -> dict:
    """What exists now of this prefix: the state file's names plus the prefix's exact name patterns."""
    ns_re = re.compile(rf"^{re.escape(prefix)}-n\d+$")
    link_re = re.compile(rf"^{re.escape(prefix)}-(br0|v\d+|p\d+)$")
    want_ns = set((state or {}).get("namespaces", []))
    want_links = set((state or {}).get("host_links", [])) | set((state or {}).get("peer_links", []))
    if state and state.get("bridge"):
        want_links.add(state["bridge"])
    ns_now = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
    links_now = {l["ifname"] for l in json.loads(_sh(["ip", "-j", "link", "show"]).stdout or "[]")}
    return {"namespaces": sorted(n for n in ns_now if n in want_ns or ns_re.match(n)),
            "links": sorted(l for l in links_now if l in want_links or link_re.match(l))}


def down(prefix: str = DEFAULT_PREFIX, grace: float = 2.0) -> dict:
    """Remove everything `up` made for `prefix` (idempotent; works after a partial up). Returns
    what was removed: {"pids": [...], "namespaces": [...], "links": [...], "state": bool}."""
    _check_prefix(prefix)
    if os.geteuid() != 0:
        raise HarnessError("the netns harness needs root (ip netns, veth, tc)")
    state = read_state(prefix)
    found = _existing(prefix, state)
    # 1. processes: the recorded ones (same start time = same process) and anything in our namespaces.
    recorded = [(p["pid"], p.get("starttime")) for p in (state or {}).get("pids", [])]
    recorded += [(p["pid"], p.get("starttime")) for r in (state or {}).get("ray", []) for p in r.get("pids", [])]
    killed = kill_pids(recorded + [(p, _proc_starttime(p)) for p in pids_in_namespaces(found["namespaces"])], grace)
    for _ in range(3):      # anything a dying process spawned meanwhile
        rest = pids_in_namespaces(found["namespaces"])
        if not rest:
            break
        killed += kill_pids([(p, _proc_starttime(p)) for p in rest], grace=2.0)
    # 2. links (deleting the host end of a veth removes its peer too), then the bridge, then namespaces.
    links = sorted(found["links"], key=lambda l: l.endswith("-br0"))
    for link in links:
        _sh(["ip", "link", "del", link], check=False)
    for ns in found["namespaces"]:
        _sh(["ip", "netns", "del", ns], check=False)
    left = _existing(prefix, state)
    if left["namespaces"] or left["links"]:
        raise HarnessError(f"down left {left['namespaces'] + left['links']} behind")
    had_state = state is not None
    with _locked_state(prefix) as box:
        box["state"] = None
    return {"pids": sorted(set(killed)), "namespaces": found["namespaces"], "links": links, "state": had_state}


# ----------------------------------------------------------------------------- Ray on the harness

def _ray_pids(harness: Harness, i: int, marker: str, extra_roots: set[int] = frozenset()
              ) -> list[tuple[int, int | None, str]]:
    """Ray processes of node i: in namespace i, whose command line names `marker` (the node's temp dir)
    or that are in `extra_roots`, and descendants of those (Ray workers rename themselves `ray::...`)."""
    inside = pids_in_namespaces([harness.ns_names[i]])
    roots = {p for p in inside if marker in _proc_cmdline(p) or p in extra_roots}
    ray = set(roots)
    for p in inside:
        q, hops = _proc_ppid(p), 0
        while q and q > 1 and hops < 64:
            if q in roots:
                ray.add(p)
                break
            q, hops = _proc_ppid(q), hops + 1
    return [(p, _proc_starttime(p), _proc_cmdline(p)[:120]) for p in sorted(ray)]


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def ray_env(extra: dict | None = None) -> dict:
    """Environment for Ray processes and drivers on the harness: token auth as the rest of our tests."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", **(extra or {})}


def start_ray(harness: Harness, temp_root: str, num_cpus: int = 1, object_store_memory: int = 100 * 1024 * 1024,
              port: int = RAY_PORT, env: dict | None = None, timeout: float = 120) -> str:
    """`ray start --head` in namespace 0 bound to its IP, then one worker per other namespace joining
    it. Each node gets its own temp dir `<temp_root>/n<i>` (keep temp_root short: Ray's socket paths
    live under it). Token auth (RAY_AUTH_MODE=token). Returns the address "ip:port"."""
    env = ray_env({**harness.gloo_env, **(env or {})})
    address = f"{harness.ips[0]}:{port}"
    common = [f"--num-cpus={num_cpus}", f"--object-store-memory={object_store_memory}", "--disable-usage-stats"]
    for i in range(len(harness.ns_names)):
        temp = os.path.join(temp_root, f"n{i}")
        os.makedirs(temp, exist_ok=True)
        argv = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--node-ip-address={harness.ips[i]}",
                f"--temp-dir={temp}", *common]
        argv += ([ "--head", f"--port={port}", "--include-dashboard=false"] if i == 0 else [f"--address={address}"])
        before = set(pids_in_namespaces([harness.ns_names[i]]))
        try:
            proc = harness.exec(i, argv, env=env, capture_output=True, text=True, timeout=timeout)
        finally:
            # what `ray start` left running in the namespace: every new process (some, like the
            # Ray client server, do not name the temp dir) plus anything naming the temp dir
            new = set(pids_in_namespaces([harness.ns_names[i]])) - before
            pids = _ray_pids(harness, i, temp, extra_roots=new)
            with _locked_state(harness.prefix) as box:
                if box["state"] is not None:
                    box["state"].setdefault("ray", []).append(
                        {"node": i, "temp_dir": temp, "address": address,
                         "pids": [{"pid": p, "starttime": st, "what": w} for p, st, w in pids]})
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise HarnessError(f"ray start on {harness.ns_names[i]} failed: {' | '.join(tail)}")
    harness.ray_address = address
    return address


def stop_ray(harness: Harness, grace: float = 2.0) -> list[int]:
    """Stop the Ray nodes start_ray started, by PID (never `ray stop`, which stops every Ray
    process on the host). Returns the PIDs signalled."""
    state = read_state(harness.prefix) or {}
    nodes = state.get("ray", [])
    procs = [(p["pid"], p.get("starttime")) for r in nodes for p in r.get("pids", [])]
    # processes Ray started after start_ray returned (workers, agents): found again by temp dir
    for r in nodes:
        procs += [(p, st) for p, st, _ in _ray_pids(harness, r["node"], r["temp_dir"])]
    killed = kill_pids(procs, grace)
    for r in nodes:                    # a second pass for stragglers spawned during shutdown
        rest = _ray_pids(harness, r["node"], r["temp_dir"])
        killed += kill_pids([(p, st) for p, st, _ in rest], grace=1.0)
    with _locked_state(harness.prefix) as box:
        if box["state"] is not None:
            box["state"]["ray"] = []
    harness.ray_address = None
    return sorted(set(killed))


# ----------------------------------------------------------------------------- CLI

def status(prefix: str = DEFAULT_PREFIX) -> dict:
    state = read_state(prefix)
    found = _existing(prefix, state)
    return {"prefix": prefix, "state_file": state_path(prefix) if state else None, "up": state is not None,
            "namespaces": found["namespaces"], "links": found["links"],
            "ips": (state or {}).get("ips"), "bandwidth": (state or {}).get("bandwidth"),
            "delay": (state or {}).get("delay"),
            "ray_address": ((state or {}).get("ray") or [{}])[0].get("address"),
            "pids": {ns: pids_in_namespaces([ns]) for ns in found["namespaces"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="netns", description="Local multi-node harness in network namespaces.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="create the namespaces, bridge and shaped links")
    u.add_argument("--nodes", type=int, default=2)
    u.add_argument("--bandwidth", default=None, help="tc rate per link and direction, e.g. 1gbit (default: unshaped)")
    u.add_argument("--delay", default=None, help="one-way netem delay, e.g. 1ms (needs sch_netem)")
    u.add_argument("--subnet", default=DEFAULT_SUBNET)
    u.add_argument("--ray", metavar="TEMP_ROOT", default=None,
                   help="also start Ray: head in n0, a worker in each other namespace, temp dirs under TEMP_ROOT")
    for name, text in (("down", "remove everything up made (and its processes)"), ("status", "show what exists")):
        sub.add_parser(name, help=text)
    for p in sub.choices.values():
        p.add_argument("--prefix", default=DEFAULT_PREFIX)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "up":
            h = up(args.nodes, args.bandwidth, args.delay, prefix=args.prefix, subnet=args.subnet)
            print(f"up: {len(h.ns_names)} namespaces {', '.join(h.ns_names)}; ips {', '.join(h.ips)}; "
                  f"bridge {h.bridge} {h.bridge_ip}; bandwidth {h.bandwidth or 'unshaped'}; "
                  f"delay {h.delay or 'none'}; ifname {h.ifname}")
            if args.ray:
                try:
                    addr = start_ray(h, args.ray)
                except BaseException:
                    down(args.prefix)
                    raise
                print(f"ray: head {addr} (RAY_AUTH_MODE=token); e.g. "
                      f"ip netns exec {h.ns_names[0]} env RAY_AUTH_MODE=token python -c "
                      f"\"import ray; ray.init(address='{addr}'); print(ray.nodes())\"")
        elif args.cmd == "down":
            r = down(args.prefix)
            if not (r["pids"] or r["namespaces"] or r["links"] or r["state"]):
                print(f"down: nothing of prefix {args.prefix!r} exists")
            else:
                print(f"down: stopped {len(r['pids'])} processes; removed namespaces {r['namespaces']}, "
                      f"links {r['links']}" + (", state file" if r["state"] else ""))
        else:
            print(json.dumps(status(args.prefix), indent=1))
    except HarnessError as e:
        print(f"netns: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
