"""Job entrypoint: run a profile through the Python API and print its summary as JSON.

    python jobs/train.py jobs/configs/tiny.yaml train.max_steps=4
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python jobs/train.py jobs/configs/quickstart.yaml

Inside a Ray job RAY_ADDRESS is set, so the run joins the job's cluster.
"""
from __future__ import annotations

import json
import sys

import rapidfire_ray
from rapidfire_ray.config import parse_overrides


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        summary = rapidfire_ray.train(argv[0], overrides=dict(parse_overrides(argv[1:])))
    except rapidfire_ray.RapidfireError as e:
        print(f"rapidfire: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("stage", "steps", "tokens_per_s", "final_loss", "model_dir")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
