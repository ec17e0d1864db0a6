"""`rapidfire doctor`: check a run before starting it, and say what to fix.

    rapidfire doctor --profile PATH [--address ADDR] [--sample N] [--json] [key=value ...]

Checks, in order: the config loads and validates, and passes the NaN checklist
(`rapidfire_ray.diagnose`); the first N data rows, read, validated and tokenised by the same code
the run uses (no Ray started), have no bad rows, abnormal tokens or rows with nothing to train on;
the cluster at `--address`/RAY_ADDRESS answers, token auth is configured, and its nodes hold the
requested workers; NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME name interfaces of this host. Exit code 1
when a finding has error severity (the run would fail), else 0.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from .diagnose import Finding, check_config, check_token_rows, has_errors
from .config import worker_range
from .errors import RapidfireError

DEFAULT_SAMPLE = 200
MAX_PER_CODE = 5  # row-level findings shown per kind; the rest are counted in one line
PROBE_TIMEOUT_S = 60

# Run in a subprocess so a hanging or failing ray.init never takes the doctor down with it.
_PROBE = """
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
print("RAPIDFIRE_PROBE " + json.dumps({"nodes": nodes, "available": ray.available_resources()}))
"""


def diagnose_run(profile: str, overrides: list[str] = (), *, address: str | None = None,
                 sample: int = DEFAULT_SAMPLE) -> list[Finding]:
    """Every finding for the run `profile` + `overrides` would start (see the module docstring)."""
    from .config import load_config

    address = address or os.environ.get("RAY_ADDRESS") or None
    try:
        cfg = load_config(profile, overrides)
    except RapidfireError as e:
        return [Finding("error", "config", profile, str(e), "fix the config (see docs/config.md)"),
                *check_cluster_address(address), *check_interfaces(use_gpu=None)]
    findings = check_config(cfg) + check_data(cfg, sample)
    findings += check_cluster(cfg, address) + check_interfaces(use_gpu=cfg.scaling.use_gpu)
    return findings


# ----------------------------------------------------------------------------------------------
# data


def read_sample(cfg, n: int) -> list[dict]:
    """The first `n` records (good and bad, see `data.formats`) of the run's data files, parsed by
    `data.sources.parse_file`. JSON Lines files are read only as far as needed (oasst files whole:
    their conversations span the file)."""
    from .data.sources import JSONL_SUFFIXES, list_data_files, parse_file

    records: list[dict] = []
    for path in list_data_files(cfg.data.path):
        if len(records) >= n:
            break
        with open(path, "rb") as f:
            partial = path.lower().endswith(JSONL_SUFFIXES) and cfg.data.format != "oasst"
            content = b"".join(itertools.islice(f, n - len(records))) if partial else f.read()
        records += parse_file(path, content, cfg.data.format)
    return records[:n]


def model_vocab_size(name: str, tokenizer) -> int:
    """The model's embedding rows: `vocab_size` of a local model directory's config.json, else the
    tokenizer's length (built-ins and hub models ship matching tokenizers)."""
    config = Path(os.path.expanduser(name)) / "config.json"
    if config.is_file():
        size = json.loads(config.read_text(encoding="utf-8")).get("vocab_size")
        if isinstance(size, int):
            return size
    return len(tokenizer)


def check_data(cfg, sample: int) -> list[Finding]:
    """Read, validate and tokenise the first `sample` rows as the run would, and scan them."""
    from .data.tokenize import SFTTokenizer

    d = cfg.data
    try:
        records = read_sample(cfg, sample)
        # No limit here: rows are cut to data.max_length below, so overlong rows can be counted.
        tokenizer = SFTTokenizer(cfg.model.name, d.format, sys.maxsize)
    except RapidfireError as e:
        return [Finding("error", "data", "data.path", str(e), "fix data.path / model.name")]
    good = [r for r in records if not r["error"]]
    severity = "error" if d.on_bad_row == "fail" else "warning"
    action = "the run stops here (data.on_bad_row: fail)" if d.on_bad_row == "fail" else "skipped by the run"
    row_findings = [Finding(severity, "bad_row", r["source"], f"{r['error']}; {action}", "fix or remove the row")
                    for r in records if r["error"]]
    if not good:
        return _cap(row_findings) + [Finding("error", "no_usable_rows", "data.path",
                                             f"none of the first {len(records)} rows is usable",
                                             f"check that data.format ('{d.format}') matches the file")]
    batch = {k: [r[k] for r in good] for k in ("source", "text", "prompt", "completion", "messages")}
    if d.format == "preference":  # each side of a pair is scanned as a row of its own
        import numpy as np

        from .data.preference import PreferenceTokenizer

        tokenizer = PreferenceTokenizer(cfg.model.name, sys.maxsize)
        pairs = [tokenizer.pair(r["prompt"], r["chosen"], r["rejected"], r["messages"]) for r in good]
        sides = [np.asarray(ids) for pair in pairs for ids in pair]
        tokens = {"input_ids": sides, "loss_mask": [np.ones(len(ids), np.int8) for ids in sides],
                  "source": [r["source"] for r in good for _ in range(2)]}
    else:
        tokens = tokenizer(batch)
    lengths = [len(ids) for ids in tokens["input_ids"]]
    ids = [x[: d.max_length].tolist() for x in tokens["input_ids"]]
    untrained = [s for s, m in zip(tokens["source"], tokens["loss_mask"]) if not m[: d.max_length].any()]
    row_findings += check_token_rows(ids, vocab_size=model_vocab_size(cfg.model.name, tokenizer.tokenizer),
                                     sources=tokens["source"])
    findings = _cap(row_findings)
    overlong = sum(n > d.max_length for n in lengths)
    if overlong:
        done = "dropped (data.overlong: drop)" if d.overlong == "drop" else "truncated"
        findings.append(Finding("warning" if d.overlong == "drop" else "info", "overlong", "data.max_length",
                                f"{overlong} of {len(good)} sampled rows are longer than {d.max_length} tokens "
                                f"(longest {max(lengths)}); they will be {done}",
                                f"raise data.max_length if their ends matter (longest: {max(lengths)})"))
    if untrained:
        everything = len(untrained) == len(good)
        findings.append(Finding("error" if everything else "warning", "nothing_trained", "data.max_length",
                                f"{len(untrained)} of {len(good)} sampled rows have nothing to train on within "
                                f"{d.max_length} tokens (e.g. {untrained[0]}); the run skips them",
                                "raise data.max_length or shorten the prompts"))
    findings.append(Finding("info", "data_sample", d.path,
                            f"{len(records)} rows read ({len(records) - len(good)} bad), {sum(lengths)} tokens, "
                            f"longest {max(lengths)}"))
    return findings


def _cap(findings: list[Finding]) -> list[Finding]:
    """At most MAX_PER_CODE findings per code, then one line counting the rest."""
    by_code: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        by_code[f.code].append(f)
    out = []
    for code, group in by_code.items():
        out += group[:MAX_PER_CODE]
        if len(group) > MAX_PER_CODE:
            first = group[0]
            out.append(Finding(first.severity, code, "data.path",
                               f"{len(group) - MAX_PER_CODE} more rows like {first.where}", first.fix))
    return out


# ----------------------------------------------------------------------------------------------
# cluster


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) for an `ip:port` address; None for `auto`, `ray://...`, `http://...`."""
    host, sep, port = address.rpartition(":")
    if not sep or "://" in address or not port.isdigit():
        return None
    return host, int(port)


def _token_available() -> bool:
    """Whether Ray would find an auth token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return True
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return bool(path.read_text(encoding="utf-8").strip())
    except OSError:
        return False


def check_cluster_address(address: str | None) -> list[Finding]:
    """Reachability (TCP) and token-auth settings of an ip:port address; nothing for others."""
    target = _host_port(address) if address else None
    if target is None:
        return []
    try:
        socket.create_connection(target, timeout=5).close()
    except OSError as e:
        return [Finding("error", "cluster_unreachable", f"address {address}",
                        f"nothing answers at {address} ({e.strerror or e})",
                        "check the address (the head node's GCS port, 6379 by default) and that "
                        "`ray start --head` is running there")]
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is None:
        return [Finding("warning", "auth_mode", "RAY_AUTH_MODE",
                        "not set: an explicit address does not turn token auth on, so a cluster started with "
                        "a token (Ray's default) refuses the connection",
                        "export RAY_AUTH_MODE=token and the cluster's token (~/.ray/auth_token, RAY_AUTH_TOKEN "
                        "or RAY_AUTH_TOKEN_PATH)")]
    if mode.lower() == "token" and not _token_available():
        return [Finding("error", "auth_token", "RAY_AUTH_MODE",
                        "token auth is on but no token was found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, "
                        "~/.ray/auth_token)",
                        "copy the head node's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN")]
    return []


def workers_that_fit(nodes: list[dict], cpus_per_worker: int, use_gpu: bool) -> int:
    """How many workers (cpus_per_worker CPUs, and one GPU with use_gpu) the nodes can hold."""
    fit = 0
    for res in nodes:
        n = int(res.get("CPU", 0) // cpus_per_worker)
        if use_gpu:
            n = min(n, int(res.get("GPU", 0)))
        fit += n
    return fit


def probe_resources(address: str) -> dict:
    """{"nodes": [resources of each alive node], "available": {...}} of the cluster at `address`,
    from a short-lived Ray driver. Raises RapidfireError with Ray's reason when it cannot join."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RapidfireError(f"joining the cluster took over {PROBE_TIMEOUT_S} s") from None
    for line in out.stdout.splitlines():
        if line.startswith("RAPIDFIRE_PROBE "):
            return json.loads(line.split(" ", 1)[1])
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else f"exit code {out.returncode}"
    raise RapidfireError(next((ln for ln in reversed(lines) if "Error" in ln), last).strip()[:300])


def check_cluster(cfg, address: str | None) -> list[Finding]:
    """The cluster the run would use: reachable, authenticated, big enough for its workers."""
    s = cfg.scaling
    workers = worker_range(cfg)[0]  # an elastic run starts once its minimum fits
    need = f"{workers} worker(s) x {s.cpus_per_worker} CPU" + (" + 1 GPU" if s.use_gpu else "")
    if not address:
        if s.use_gpu:
            import torch

            gpus = torch.cuda.device_count()
            if gpus < workers:
                return [Finding("error", "resources", "scaling.num_workers",
                                f"{need} on the embedded local cluster, but this machine has {gpus} GPU(s)",
                                f"set scaling.num_workers={gpus}" if gpus else "set scaling.use_gpu=false")]
        return [Finding("info", "cluster", "address", "none given: the run starts an embedded local Ray cluster")]
    findings = check_cluster_address(address)
    if has_errors(findings):
        return findings
    if address.startswith(("http://", "https://")):
        return findings + [Finding("info", "cluster", f"address {address}",
                                   "a job-submission (dashboard) address: resources not checked")]
    try:
        probe = probe_resources(address)
    except RapidfireError as e:
        return findings + [Finding("error", "cluster_join", f"address {address}", f"could not join: {e}",
                                   "check the address, RAY_AUTH_MODE=token and the token, and that the Ray "
                                   "versions match")]
    fit = workers_that_fit(probe["nodes"], s.cpus_per_worker, s.use_gpu)
    total = {k: sum(n.get(k, 0) for n in probe["nodes"]) for k in ("CPU", "GPU")}
    have = f"{len(probe['nodes'])} node(s), {total['CPU']:g} CPUs, {total['GPU']:g} GPUs"
    if fit < workers:
        return findings + [Finding("error", "resources", "scaling.num_workers",
                                   f"{need} requested, but the cluster ({have}) holds {fit}",
                                   f"set scaling.num_workers={fit}" if fit else "add nodes, or lower "
                                   "scaling.cpus_per_worker")]
    findings.append(Finding("info", "cluster", f"address {address}", f"{have}; room for {fit} worker(s) ({need})"))
    avail = probe["available"]
    if avail.get("CPU", 0) < workers * s.cpus_per_worker or (s.use_gpu and avail.get("GPU", 0) < workers):
        findings.append(Finding("warning", "resources_busy", f"address {address}",
                                f"only {avail.get('CPU', 0):g} CPUs / {avail.get('GPU', 0):g} GPUs free now; the "
                                "run waits for other jobs to release theirs"))
    return findings


# ----------------------------------------------------------------------------------------------
# network interfaces


def _host_interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def check_interfaces(use_gpu: bool | None, env=None, interfaces: list[str] | None = None) -> list[Finding]:
    """NCCL_SOCKET_IFNAME (NCCL syntax: prefixes, `=` exact names, `^` exclusions) and
    GLOO_SOCKET_IFNAME (exact names) must name interfaces of this host. NCCL problems are errors
    only for GPU workers (`use_gpu`; None: unknown), gloo problems for CPU workers."""
    env = os.environ if env is None else env
    interfaces = _host_interfaces() if interfaces is None else interfaces
    shown = ", ".join(interfaces)
    findings = []
    nccl, gloo = env.get("NCCL_SOCKET_IFNAME", "").strip(), env.get("GLOO_SOCKET_IFNAME", "").strip()
    if nccl:
        exclude = nccl.startswith("^")
        spec = nccl.lstrip("^")
        exact = spec.startswith("=")
        names = [n for n in spec.lstrip("=").split(",") if n]

        def hit(iface: str) -> bool:
            return any(iface == n if exact else iface.startswith(n) for n in names)

        matched = [i for i in interfaces if hit(i) != exclude]
        if not matched:
            findings.append(Finding("error" if use_gpu is not False else "warning", "nccl_ifname",
                                    "NCCL_SOCKET_IFNAME", f"{nccl!r} leaves NCCL no interface on this host "
                                    f"(interfaces: {shown})", "name one of them, or unset it"))
    if gloo:
        missing = [n for n in gloo.split(",") if n and n not in interfaces]
        if missing:
            findings.append(Finding("error" if use_gpu is not True else "warning", "gloo_ifname",
                                    "GLOO_SOCKET_IFNAME", f"{', '.join(missing)} not an interface of this host "
                                    f"(interfaces: {shown})", "name one of them, or unset it"))
    return findings


# ----------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire doctor", description="Check a run's config, data sample and "
                                "cluster before starting it; exit code 1 if something would fail.")
    p.add_argument("--profile", required=True, help="path to the run's train_config.yaml")
    p.add_argument("--address", default=None, help="Ray cluster to check (ip:port or auto; default: $RAY_ADDRESS, "
                   "else the embedded local cluster)")
    p.add_argument("--sample", type=int, default=DEFAULT_SAMPLE, metavar="N", help="data rows to read and scan")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for rapidfire train")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sample < 1:
        _parser().error("--sample must be at least 1")
    findings = diagnose_run(args.profile, args.overrides, address=args.address, sample=args.sample)
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    if args.json:
        print(json.dumps({"ok": not errors, "errors": errors, "warnings": warnings,
                          "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        for f in findings:
            print(f)
        print(f"doctor: {errors} error(s), {warnings} warning(s)" + ("; the run would fail" if errors else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
