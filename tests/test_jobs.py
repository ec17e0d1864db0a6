"""The job entrypoint in jobs/ runs a profile through the Python API, as a user's job would."""
from __future__ import annotations

import json
import os
import runpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_jobs_train_entrypoint_runs_a_profile(ray_cluster, tmp_path, capsys):
    main = runpy.run_path(os.path.join(REPO, "jobs", "train.py"))["main"]
    rc = main([os.path.join(REPO, "jobs", "configs", "tiny.yaml"), f"run.output_dir={tmp_path}",
               "train.max_steps=2", "checkpoint.every_steps=0", "scaling.num_workers=1"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["steps"] == 2 and printed["stage"] == "sft" and os.path.isdir(printed["model_dir"])
    assert main(["--help"]) == 2
