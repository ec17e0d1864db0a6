"""`rapidfire experiment`: run an experiment, show its leaderboard (`status`), steer it (`ctl`)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import RapidfireError, run_command

USAGE = """rapidfire experiment --profile P [--address A] [--resume] [--verbose] [key=value ...]
       rapidfire experiment status (--profile P | DIR) [--json]
       rapidfire experiment ctl stop|resume|delete RUN [--name EXPERIMENT] [--address A]
       rapidfire experiment ctl clone RUN key=value ... [--warm] [--name EXPERIMENT] [--address A]"""


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire experiment", usage=USAGE,
                                description="many configs side by side, compared chunk by chunk")
    p.add_argument("--profile", required=True, help="an experiment profile (a config with an experiment section)")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: $RAY_ADDRESS, else embedded)")
    p.add_argument("--resume", action="store_true", help="continue a stopped experiment from its last chunk boundaries")
    p.add_argument("--verbose", action="store_true", help="also show the libraries' own output")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="base or experiment.* keys")
    return p


def _status_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire experiment status", usage=USAGE)
    p.add_argument("dir", nargs="?", default=None, help="the experiment folder (run.output_dir/run.name)")
    p.add_argument("--profile", default=None, help="the experiment's profile (its folder from run.*)")
    p.add_argument("--json", action="store_true", help="print experiment_summary.json")
    return p


def _ctl_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire experiment ctl", usage=USAGE)
    p.add_argument("op", choices=("stop", "resume", "delete", "clone"))
    p.add_argument("run", help="the config id (c0, c1, ...; see rapidfire experiment status)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="clone: the values that differ")
    p.add_argument("--warm", action="store_true", help="clone: start from the parent's state and data position")
    p.add_argument("--name", default=None, help="the experiment (run.name; default: the only one running)")
    p.add_argument("--address", default=None, help="its Ray cluster (default: $RAY_ADDRESS, else auto)")
    return p


def connect_to(address: str | None) -> None:
    from ..monitor import NoRun, _connect

    try:
        _connect(address)
    except NoRun as e:
        raise RapidfireError(str(e).replace("rapidfire train", "rapidfire experiment")) from None


def main(argv: list[str]) -> int:
    def command() -> int:
        if argv and argv[0] == "status":
            return _status(_status_parser().parse_args(argv[1:]))
        if argv and argv[0] == "ctl":
            return _ctl(_ctl_parser().parse_intermixed_args(argv[1:]))
        return _run(_run_parser().parse_intermixed_args(argv), argv)

    return run_command(command)


def _run(args, argv) -> int:
    from ..log import set_verbose
    from .spec import load_experiment

    load_experiment(args.profile, args.overrides)  # a bad profile fails here, before Ray starts
    set_verbose(args.verbose)
    from .driver import run_experiment

    run_experiment(args.profile, args.overrides, address=args.address, resume=args.resume)
    return 0


def _status(args) -> int:
    from .summary import SUMMARY, render_leaderboard

    if args.dir is None and args.profile is None:
        raise RapidfireError("experiment status: pass the experiment folder or --profile P")
    folder = args.dir
    if folder is None:
        from .spec import load_experiment

        folder = load_experiment(args.profile).folder
    path = os.path.join(folder, SUMMARY)
    if not os.path.isfile(path):
        raise RapidfireError(f"experiment status: no {SUMMARY} in {folder}; has the experiment started?")
    with open(path, encoding="utf-8") as f:
        summary = json.load(f)
    print(json.dumps(summary, indent=2) if args.json else render_leaderboard(summary))
    return 0


def _ctl(args) -> int:
    from ..config.load import parse_overrides
    from . import ctl

    if args.op != "clone" and (args.overrides or args.warm):
        raise RapidfireError(f"ctl {args.op}: key=value and --warm go with clone only")
    entry = ctl(args.op, args.run, dict(parse_overrides(args.overrides)), warm=args.warm, experiment=args.name,
                address=args.address)
    print(f"[rapidfire] ctl {entry['op']} {entry['run']} queued as op {entry['op_id']} on experiment "
          f"{entry['experiment']}; applied at that config's next chunk boundary")
    return 0
