"""A Ray head of a test's own: its own temp dir, ports, auth token file; stopped by its own
process ids (never `ray stop`, which stops every Ray cluster on the machine).

    with PrivateHead(num_cpus=3, dashboard=True) as head:
        head.env        # environment for clients: RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH=<its token>
        head.address    # "127.0.0.1:<gcs port>"
        head.dashboard  # "http://127.0.0.1:<port>" (dashboard=True)
        head.headers    # {"Authorization": "Bearer <token>"} for the job API
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(name))
    return out


def cluster_pids(markers: list[str]) -> list[int]:
    """Processes whose command line names one of `markers` (the head's temp dir, its GCS address
    for the Ray client server), and all their descendants."""
    marks = [m.encode() for m in markers]
    roots = [int(p) for p in os.listdir("/proc") if p.isdigit() and any(m in _cmdline(int(p)) for m in marks)]
    kids = _children()
    seen: set[int] = set()
    stack = [p for p in roots if p != os.getpid()]
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        stack.extend(kids.get(p, []))
    return sorted(seen)


class PrivateHead:
    def __init__(self, *, num_cpus: int = 2, dashboard: bool = False, resources: dict | None = None,
                 autoscaling_config: str | None = None, extra_env: dict | None = None):
        self.temp = tempfile.mkdtemp(prefix="rf-head-", dir="/tmp")
        self.port = free_port()
        self.num_cpus = num_cpus
        self.dashboard_port = free_port() if dashboard else None
        self.resources = resources
        self.autoscaling_config = autoscaling_config
        token = os.path.join(self.temp, "token")
        self.token = secrets.token_hex(32)
        with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(self.token)
        bindir = os.path.dirname(sys.executable)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token,
                    "PATH": f"{bindir}:{os.environ.get('PATH', '')}", **(extra_env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}" if dashboard else None
        self.headers = {"Authorization": f"Bearer {self.token}"}

    def start(self) -> "PrivateHead":
        import json

        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={self.port}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}", f"--temp-dir={self.temp}/ray",
               f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               # Fixed agent ports: otherwise the raylet waits (and, on a loaded machine, gives up) for
               # the agents to write the ports they picked.
               f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
               f"--metrics-export-port={free_port()}",
               "--disable-usage-stats"]
        if self.dashboard_port:
            cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"]
        else:
            cmd += ["--include-dashboard=false"]
        if self.resources:
            cmd += [f"--resources={json.dumps(self.resources)}"]
        if self.autoscaling_config:
            cmd += [f"--autoscaling-config={self.autoscaling_config}"]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            self.kill()
            raise RuntimeError(f"ray start --head failed: {proc.stderr[-2000:]}")
        return self

    def start_retrying(self, tries: int = 2) -> "PrivateHead":
        """start(); on a loaded machine `ray start` sometimes times out: once more, same ports."""
        for attempt in range(tries):
            try:
                return self.start()
            except (RuntimeError, subprocess.TimeoutExpired):
                self.kill()
                if attempt == tries - 1:
                    raise
                shutil.rmtree(os.path.join(self.temp, "ray"), ignore_errors=True)
                time.sleep(5)
        return self

    def add_node(self, *, num_cpus: int, resources: dict | None = None) -> None:
        """Another raylet on this machine joining the head (a second "node"), stopped with the head."""
        import json

        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", f"--address={self.address}",
               "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", f"--temp-dir={self.temp}/ray",
               f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}",
               "--disable-usage-stats"]
        if resources:
            cmd += [f"--resources={json.dumps(resources)}"]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=240)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start --address failed: {proc.stderr[-2000:]}")

    def python(self, code: str, timeout: float = 120) -> str:
        """Run `code` in a fresh interpreter connected to this cluster (ray.init(address)); its stdout."""
        proc = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={self.address!r}, "
                               f"log_to_driver=False)\n{code}"], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        return proc.stdout

    def pids(self) -> list[int]:
        return cluster_pids([self.temp, f"--address={self.address} ", f"--address={self.address}\0",
                             f"gcs-address={self.address}"])

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.temp, ignore_errors=True)

    def kill(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + 10
            while pids and time.time() < deadline and any(os.path.exists(f"/proc/{p}") and
                                                          b"" != _cmdline(p) for p in pids):
                time.sleep(0.5)

    def __enter__(self) -> "PrivateHead":
        return self.start_retrying()

    def __exit__(self, *exc) -> None:
        self.stop()
