"""`rapidfire experiment` command lines that fail before Ray starts: exit 2, one line naming the fix."""
from __future__ import annotations

from rapidfire_ray.cli import main

from tests.paths import REPO, TINY_PROFILE

PROFILE = f"{REPO}/jobs/configs/experiment_tiny.yaml"


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    return err


def test_a_plain_profile_is_refused_with_what_to_add(capsys):
    assert main(["experiment", "--profile", TINY_PROFILE]) == 2
    assert "no 'experiment' section" in _error(capsys)


def test_a_bad_experiment_override_names_the_key(capsys):
    assert main(["experiment", "--profile", PROFILE, "experiment.policy=asha"]) == 2
    assert "experiment.policy: 'asha' is not one of: none, successive_halving, pbt" in _error(capsys)


def test_train_refuses_an_experiment_profile(capsys):
    assert main(["train", "--profile", PROFILE]) == 2
    assert "run it with rapidfire experiment --profile" in _error(capsys)


def test_status_without_a_summary_and_ctl_misuse(tmp_path, capsys):
    assert main(["experiment", "status", str(tmp_path)]) == 2
    assert "no experiment_summary.json" in _error(capsys)
    assert main(["experiment", "ctl", "stop", "c0", "optimizer.params.lr=1e-3"]) == 2
    assert "key=value and --warm go with clone only" in _error(capsys)
