"""Datasets made offline: a reasoning-gym generator written out as a JSON Lines
file of `question` / `answer` rows, which the `math` task reads
(`reflow datasets export-gym`). No data can be downloaded where ReFlow runs
its tests and examples; a procedural generator makes a dataset with known
answers, under a seed, in seconds."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from reflow.core import plugins
from reflow.tasks.gym import ReasoningGymTask


def export_gym(dataset: str, out: Path, size: int, config_json: str = "{}",
               seed: int = 0) -> Path:
    """Write `size` problems of reasoning-gym generator `dataset` to `out`
    (atomically); returns the path. The generator and its arguments are checked
    as a job spec's would be."""
    args = plugins.validate_args("task", "reasoning_gym",
                                 {"dataset": dataset, "config_json": config_json, "size": size},
                                 "generator", "export-gym")
    task = ReasoningGymTask(**dict(args))
    task.seed = seed
    data = task._dataset("train")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
    with os.fdopen(fd, "w") as f:
        for i in range(size):
            entry = data[i]
            f.write(json.dumps({"question": entry["question"], "answer": str(entry["answer"])})
                    + "\n")
    os.replace(tmp, out)
    return out
