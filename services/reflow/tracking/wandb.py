"""Weights & Biases: an offline run written to `<run_dir>/wandb` (upload it later
with `wandb sync <run_dir>/wandb/offline-run-*`), or an online run when the spec
says `tracking.wandb_mode: online` and the trainer has WANDB_API_KEY in its
environment. The config is the run's config, training fields are logged at the
step, evaluation fields under `eval/` against `eval/policy_version`, and each
generations table is a `wandb.Table` named `generations`."""

from __future__ import annotations

import os
from typing import Any

from reflow.tracking.base import GENERATION_COLUMNS, Tracker


class WandbTracker(Tracker):
    name = "wandb"

    def start(self, config: dict[str, Any]) -> None:
        settings = self.context.settings
        if settings.wandb_mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise RuntimeError("tracking.wandb_mode=online needs WANDB_API_KEY in the trainer's "
                               "environment (the chart's tracking.secretName)")
        import wandb

        self.context.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.wandb_project, name=self.context.job_id, mode=settings.wandb_mode,
            dir=str(self.context.run_dir), config=config, reinit="create_new",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                    x_disable_machine_info=True))
        self.run.define_metric("eval/policy_version")
        self.run.define_metric("eval/*", step_metric="eval/policy_version")

    def log_step(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_eval(self, step: int, policy_version: int, scalars: dict[str, float]) -> None:
        # W&B's own step only rises; an evaluation's x axis is the version it scored.
        self.run.log({"eval/policy_version": policy_version,
                      **{f"eval/{k.removeprefix('eval_')}": v for k, v in scalars.items()}},
                     step=step)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb

        table = wandb.Table(columns=list(GENERATION_COLUMNS),
                            data=[[row[c] for c in GENERATION_COLUMNS] for row in rows])
        self.run.log({"generations": table}, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # Its service process too, now: the job's end takes down this process's
        # tree, and a service still up would leave W&B's exit hook a dead socket.
        wandb.teardown()
