"""Prompt datasets a task reads from a local file: JSON Lines or Parquet, under
the operator's datasets root (reflow.core.paths), with configurable columns.

A dataset file comes from the operator's volume but its name comes from a job
spec, so the path is confined before anything is opened, the file's size and
each row are bounded, and a row is only ever read as data: strings from the
named columns, nothing imported or evaluated. Everything here raises
ValueError naming the spec field (`task.args.path`, `task.args.prompt_column`),
so a bad dataset is refused at submission, before a job starts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

from reflow.core.paths import dataset_file

# Bounds on what one job may make a service read into memory.
MAX_DATASET_BYTES = 4 << 30
MAX_ROWS = 10_000_000
MAX_FIELD_CHARS = 65_536
SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclass(frozen=True)
class Row:
    """One dataset row: its position in the file and the two columns a task uses."""

    index: int
    prompt: str
    answer: str


def _text(value: object, field: str, index: int) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        # JSON's names: the user wrote the file, not Python.
        kind = {type(None): "null", bool: "a boolean", dict: "an object", list: "an array"}[
            type(value)]
        raise ValueError(f"{field}: row {index} holds {kind}, not text or a number")
    text = str(value)
    if len(text) > MAX_FIELD_CHARS:
        raise ValueError(f"{field}: row {index} is longer than {MAX_FIELD_CHARS} characters")
    return text


def _jsonl_records(path: Path, args_field: str):
    with path.open("r", encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{args_field}.path: line {index + 1} is not JSON ({err.msg})"
                                 ) from None
            if not isinstance(record, dict):
                raise ValueError(f"{args_field}.path: line {index + 1} is not a JSON object")
            yield record


def _parquet_columns(path: Path, columns: list[str], args_field: str, names: tuple[str, str]):
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as err:  # noqa: BLE001 - a file that is not Parquet, named
        raise ValueError(f"{args_field}.path: not a readable Parquet file ({err})") from None
    for column, field_name in zip(columns, names):
        if column not in schema.names:
            raise ValueError(f"{args_field}.{field_name}: no column {column!r} in the dataset; "
                             f"its columns: {', '.join(schema.names[:20])}")
    table = pq.read_table(path, columns=columns)
    return [table.column(c).to_pylist() for c in columns]


def read_rows(path: str, root: str | os.PathLike[str], prompt_column: str, answer_column: str,
              args_field: str = "task.args") -> list[Row]:
    """Every row of the dataset at `path` (confined under `root`), as (prompt, answer)
    text from the two named columns. A missing column, a non-text value or an
    empty file is a ValueError naming the field."""
    real = dataset_file(path, root, f"{args_field}.path")
    kind = SUFFIXES.get(real.suffix.lower())
    if kind is None:
        raise ValueError(f"{args_field}.path: {real.name!r} is not a dataset file; use "
                         f"{', '.join(sorted(SUFFIXES))}")
    if real.stat().st_size > MAX_DATASET_BYTES:
        raise ValueError(f"{args_field}.path: larger than {MAX_DATASET_BYTES >> 30} GiB")
    names = ("prompt_column", "answer_column")
    rows: list[Row] = []
    if kind == "parquet":
        prompts, answers = _parquet_columns(real, [prompt_column, answer_column], args_field,
                                            names)
        pairs = zip(prompts, answers)
    else:
        def pairs_of():
            for index, record in enumerate(_jsonl_records(real, args_field)):
                for column, field_name in zip((prompt_column, answer_column), names):
                    if column not in record:
                        raise ValueError(f"{args_field}.{field_name}: row {index} has no column "
                                         f"{column!r}; its columns: {', '.join(list(record)[:20])}")
                yield record[prompt_column], record[answer_column]
        pairs = pairs_of()
    for index, (prompt, answer) in enumerate(pairs):
        if index >= MAX_ROWS:
            raise ValueError(f"{args_field}.path: more than {MAX_ROWS} rows")
        rows.append(Row(index, _text(prompt, f"{args_field}.prompt_column", index),
                        _text(answer, f"{args_field}.answer_column", index)))
    if not rows:
        raise ValueError(f"{args_field}.path: the dataset has no rows")
    return rows


def split_rows(rows: list[Row], eval_fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """(train, held-out): a seeded shuffle of the row positions, the held-out split
    the first `eval_fraction` of it (at least one row when the fraction is > 0 and
    two rows exist). The split depends on the rows and the seed only, so every
    service that reads the file draws the same one."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)  # nosec B311 # a seeded split, not security
    num_eval = int(len(rows) * eval_fraction)
    if eval_fraction > 0 and num_eval == 0 and len(rows) > 1:
        num_eval = 1
    held_out = sorted(order[:num_eval])
    train = sorted(order[num_eval:])
    return [rows[i] for i in train], [rows[i] for i in held_out]
