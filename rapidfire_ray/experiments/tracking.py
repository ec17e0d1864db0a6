"""Each config of an experiment as a run in MLflow (`experiment.tracking`).

The store: `MLFLOW_TRACKING_URI` when set (a tracking server), else a SQLite store in the
experiment folder (`mlflow.db`, so `mlflow ui --backend-store-uri sqlite:///<folder>/mlflow.db`
shows it). The MLflow experiment is named after `run.name`; a config is a run named by its id
(`c0`, ...) with tags `rapidfire.config`, `rapidfire.parent` and `rapidfire.warm_from`, its
searched values as params, and per trained chunk, at the config's optimizer step: the held-out
metric, eval_loss, train_loss, the chunk number and swap seconds. A run ends with the config's
state: done -> FINISHED, stopped or deleted -> KILLED, failed -> FAILED (the reason as a tag).

Driven from the experiment driver (`sync` at every boundary, `close` at the end): nothing runs on
the slots. An MLflow error (server unreachable, store locked) is one warning and tracking stops for
this experiment; training goes on. `--resume` finds each config's run by its tag and goes on
logging the chunks it had not logged yet.
"""
from __future__ import annotations

import os
import warnings

from ..errors import RapidfireError
from ..log import warn

STATUS = {"done": "FINISHED", "stopped": "KILLED", "deleted": "KILLED", "failed": "FAILED"}
METRICS = ("eval_loss", "perplexity", "train_loss", "swap_in_s", "swap_out_s")


def tracking_uri(folder: str) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{os.path.abspath(folder)}/mlflow.db"


def start_tracker(mode: str, name: str, folder: str) -> "MlflowTracker | None":
    """The tracker for `experiment.tracking` (auto: MLflow when it is installed), or None."""
    if mode == "none":
        return None
    try:
        import mlflow  # noqa: F401
    except ImportError:
        if mode == "mlflow":
            raise RapidfireError("experiment.tracking: mlflow, but MLflow is not installed; pip install "
                                 "'rapidfire-ray[tracking]' (or set experiment.tracking: none)") from None
        return None
    try:
        return MlflowTracker(name, folder)
    except Exception as e:  # noqa: BLE001 - tracking never stops an experiment
        warn(f"MLflow tracking off for this experiment: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        return None


class MlflowTracker:
    def __init__(self, name: str, folder: str):
        import logging

        from mlflow.tracking import MlflowClient

        for noisy in ("mlflow", "alembic"):  # store migrations print INFO lines on first use
            logging.getLogger(noisy).setLevel(logging.WARNING)
        os.makedirs(folder, exist_ok=True)
        self.uri = tracking_uri(folder)
        self.client = MlflowClient(tracking_uri=self.uri)
        with warnings.catch_warnings():  # SQLAlchemy's deprecation notes on MLflow's mappers
            warnings.simplefilter("ignore")
            found = self.client.get_experiment_by_name(name)
        self.experiment_id = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.runs: dict[str, str] = {}  # config id -> MLflow run id
        self.logged: dict[str, int] = {}  # config id -> chunks logged
        self.ended: set[str] = set()
        for run in self.client.search_runs([self.experiment_id], max_results=10_000):
            cid = run.data.tags.get("rapidfire.config")
            if cid is not None:
                self.runs[cid] = run.info.run_id
                if run.info.status != "RUNNING":
                    self.ended.add(cid)
                chunks = self.client.get_metric_history(run.info.run_id, "chunk")
                self.logged[cid] = int(max((m.value for m in chunks), default=0))
        self.ok = True

    def sync(self, summary: dict) -> None:
        """Log what is new in the experiment's summary (a boundary's records, ended configs)."""
        if not self.ok:
            return
        try:
            for c in summary["configs"]:
                self._sync_config(c)
        except Exception as e:  # noqa: BLE001 - tracking never stops an experiment
            self.ok = False
            warn(f"MLflow tracking stopped ({self.uri}): {type(e).__name__}: {str(e).splitlines()[0][:200]}")

    def _sync_config(self, c: dict) -> None:
        cid = c["id"]
        run_id = self.runs.get(cid)
        if run_id is None:
            tags = {"rapidfire.config": cid, "rapidfire.parent": c.get("parent") or "",
                    "rapidfire.warm_from": c.get("warm_from") or ""}
            run_id = self.client.create_run(self.experiment_id, run_name=cid, tags=tags).info.run_id
            self.runs[cid], self.logged[cid] = run_id, 0
            for key, value in c["values"].items():
                self.client.log_param(run_id, key, value)
        elif cid in self.ended and c["state"] == "running":  # resumed (ctl resume, --resume)
            self.client.update_run(run_id, status="RUNNING")
            self.ended.discard(cid)
        history = c.get("history") or []
        for record in history[self.logged[cid]:]:
            step = int(record.get("step", record["chunk"]))
            self.client.log_metric(run_id, "chunk", record["chunk"], step=step)
            self.client.log_metric(run_id, "score", record["score"], step=step)
            for key in METRICS:
                if isinstance(record.get(key), (int, float)):
                    self.client.log_metric(run_id, key, record[key], step=step)
        self.logged[cid] = max(self.logged[cid], len(history))
        status = STATUS.get(c["state"])
        if status is not None and cid not in self.ended:
            if c.get("reason") or c.get("error"):
                self.client.set_tag(run_id, "rapidfire.reason", (c.get("reason") or c.get("error"))[:4000])
            self.client.set_tag(run_id, "rapidfire.state", c["state"])
            self.client.set_terminated(run_id, status)
            self.ended.add(cid)

    def close(self, summary: dict) -> None:
        """The experiment ended: log the rest; configs still running (interrupted) end KILLED."""
        self.sync(summary)
        if not self.ok:
            return
        try:
            for cid, run_id in self.runs.items():
                if cid not in self.ended:
                    self.client.set_terminated(run_id, "KILLED")
        except Exception as e:  # noqa: BLE001
            warn(f"MLflow tracking: could not end the runs: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
