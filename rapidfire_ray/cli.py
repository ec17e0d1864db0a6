"""`rapidfire` command line. Exit codes: 0 success, 2 usage/config/data error, 1 run failure."""
from __future__ import annotations

import argparse
import sys

from .errors import RapidfireError, RunFailed


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rapidfire", description="Fast, reliable TRL fine-tuning on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run a training job from a train_config.yaml")
    t.add_argument("--profile", required=True, help="path to the run's train_config.yaml")
    t.add_argument("--address", default=None,
                   help="Ray cluster to join (ip:port or auto; default: $RAY_ADDRESS, else an embedded local one)")
    t.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    t.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="override any config key, e.g. train.max_steps=10")

    c = sub.add_parser("config", help="print the resolved config as YAML")
    c.add_argument("--profile", default=None, help="path to a train_config.yaml (default: the built-in defaults)")
    c.add_argument("overrides", nargs="*", metavar="key=value")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from .config import load_config, to_yaml

        cfg = load_config(args.profile, args.overrides)
        if args.command == "config" or args.dry_run:
            print(to_yaml(cfg), end="")
            return 0
        from .launcher import run

        run(cfg, address=args.address, resume=args.resume)
        return 0
    except RapidfireError as e:
        print(f"rapidfire: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"rapidfire: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rapidfire: interrupted", file=sys.stderr)
        return 130


def entrypoint() -> None:
    sys.exit(main())
