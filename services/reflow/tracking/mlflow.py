"""MLflow: a run in a local file store under `<run_dir>/mlflow` by default, or on
the server the trainer's REFLOW_MLFLOW_TRACKING_URI / MLFLOW_TRACKING_URI or the
spec's `tracking.mlflow_tracking_uri` names (a token comes from
MLFLOW_TRACKING_TOKEN, read by MLflow itself). The config is the run's flattened
parameters, fields are metrics at the step (evaluation fields at the policy
version they scored), each generations table a JSON artifact in MLflow's table
format (`generations/step_<n>.json`). Open a local store with
`mlflow ui --backend-store-uri <run_dir>/mlflow` (the UI needs the full `mlflow`
package; the trainer needs only `mlflow-skinny`)."""

from __future__ import annotations

import os
import time
from typing import Any

from reflow.tracking.base import GENERATION_COLUMNS, Tracker, flatten_config

# MLflow's batch limits: parameters and metrics per log_batch call.
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000


def tracking_uri(spec_uri: str | None, run_dir) -> str:
    """The environment's URI first (the operator's), then the spec's, then a local
    store in the run directory."""
    return (os.environ.get("REFLOW_MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
            or spec_uri or (run_dir / "mlflow").resolve().as_uri())


class MlflowTracker(Tracker):
    name = "mlflow"

    def start(self, config: dict[str, Any]) -> None:
        # Usage telemetry would try to reach the internet from the trainer's pod.
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        settings = self.context.settings
        self.uri = tracking_uri(settings.mlflow_tracking_uri, self.context.run_dir)
        if self.uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this switch; it
            # is the store that needs no database package (mlflow-skinny), offline.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.uri)
        name = settings.mlflow_experiment or self.context.job_name
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(name))
        run = self.client.create_run(experiment_id, run_name=self.context.job_id,
                                     tags={"reflow.job_id": self.context.job_id,
                                           "reflow.job_name": self.context.job_name})
        self.run_id = run.info.run_id
        params = [Param(k, v) for k, v in flatten_config(config).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def _log_metrics(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + METRICS_PER_BATCH])

    def log_step(self, step: int, scalars: dict[str, float]) -> None:
        self._log_metrics(scalars, step)

    def log_eval(self, step: int, policy_version: int, scalars: dict[str, float]) -> None:
        self._log_metrics(scalars, policy_version)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = {"columns": list(GENERATION_COLUMNS),
                 "data": [[row[c] for c in GENERATION_COLUMNS] for row in rows]}
        self.client.log_dict(self.run_id, table, f"generations/step_{step:08d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")
