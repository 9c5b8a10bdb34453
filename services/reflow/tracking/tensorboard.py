"""TensorBoard: event files in `<run_dir>/tensorboard`, written with torch's
SummaryWriter. Training fields are scalars at the step, evaluation fields at the
policy version they scored, the config and each generations table Markdown text.
Open with `tensorboard --logdir <run_dir>/tensorboard`."""

from __future__ import annotations

from typing import Any

import yaml

from reflow.tracking.base import Tracker, markdown_table

# How often the writer flushes on its own, so a live TensorBoard keeps up.
FLUSH_S = 10


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def start(self, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = self.context.run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=FLUSH_S)
        # Indented four spaces: a Markdown code block, shown as written.
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log_step(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_eval(self, step: int, policy_version: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, policy_version)

    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.writer.add_text("generations", markdown_table(rows), step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
