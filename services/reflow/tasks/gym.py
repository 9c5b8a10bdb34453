"""The built-in task `reasoning_gym`: any procedural generator of the
`reasoning-gym` package, chosen by its registered name, with its own arguments
and seed, scored by the generator's own `score_answer`.

A prompt carries only its split and index (`answer` is "train:17"): every
service rebuilds the same dataset from the same name, arguments and seed, so
the scorer in a reward pool process looks the entry up itself, and nothing but
two short strings crosses the network. The held-out split is the same generator
under a seed of its own (procedural data: disjoint up to chance repeats of
short problems).

The generator's arguments arrive as a JSON object in one string (`config_json`),
since a spec's plug-in arguments are flat scalars; they are parsed as data and
checked against the generator's own config class before any generation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reflow.tasks.answers import canonical_answer, last_boxed
from reflow.tasks.base import Prompt, TaskContext

EVAL_SEED_OFFSET = 1_000_003
# Generators built from other generators' specs: not nameable from a job spec.
EXCLUDED = frozenset({"composite"})
MAX_CONFIG_ITEMS = 32


def _generators() -> dict[str, Any]:
    from reasoning_gym.factory import DATASETS

    return {name: spec for name, spec in DATASETS.items() if name not in EXCLUDED}


def _generator_config(config_json: str) -> dict[str, Any]:
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as err:
        raise ValueError(f"not a JSON object ({err.msg})") from None
    if not isinstance(config, dict) or len(config) > MAX_CONFIG_ITEMS:
        raise ValueError(f"must be a JSON object of at most {MAX_CONFIG_ITEMS} arguments")
    for key, value in config.items():
        values = value if isinstance(value, list) else [value]
        if key in ("seed", "size") or not all(
                isinstance(v, (bool, int, float, str)) and len(str(v)) <= 256 for v in values):
            raise ValueError(f"argument {key!r}: scalars or lists of scalars only (seed and size "
                             "are the task's own seed and size)")
        if isinstance(value, list):
            config[key] = tuple(value)
    return config


class ReasoningGymTask:
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        dataset: str = Field(min_length=1, max_length=128,
                             description="A reasoning-gym generator by name (e.g. "
                             "basic_arithmetic, chain_sum, gsm_symbolic).")
        config_json: str = Field(default="{}", max_length=4096,
                                 description="The generator's own arguments, as a JSON object "
                                 '(e.g. {"min_terms": 2, "max_terms": 3}).')
        size: int = Field(default=100_000, ge=1, le=10_000_000,
                          description="Training prompts before the stream starts over.")
        eval_size: int = Field(default=200, ge=1, le=100_000,
                               description="Prompts in the held-out split.")
        instruction: str = Field(default="Put your final answer within \\boxed{}.",
                                 max_length=1024,
                                 description="Appended to every question (a blank line between).")
        system_prompt: str = Field(default="", max_length=4096,
                                   description="A system message; empty: the template's default.")

        @field_validator("dataset")
        @classmethod
        def _known(cls, name: str) -> str:
            known = _generators()
            if name not in known:
                close = sorted(n for n in known if n[:3] == name[:3])[:8]
                raise ValueError(f"no reasoning-gym generator {name!r}"
                                 + (f"; similar: {', '.join(close)}" if close else ""))
            return name

        @field_validator("config_json")
        @classmethod
        def _parse(cls, text: str) -> str:
            _generator_config(text)
            return text

    def __init__(self, dataset: str, config_json: str = "{}", size: int = 100_000,
                 eval_size: int = 200, instruction: str = "", system_prompt: str = "",
                 context: TaskContext | None = None) -> None:
        self.name = dataset
        self.config = _generator_config(config_json)
        self.size, self.eval_size = size, eval_size
        self.instruction, self.system_prompt = instruction, system_prompt
        self.seed = (context or TaskContext()).seed
        self._datasets: dict[str, Any] = {}

    @classmethod
    def check(cls, args: Args, context: TaskContext) -> None:
        """At submission: the generator accepts its arguments and yields a problem."""
        task = cls(**dict(args), context=context)
        task._dataset("train")[0]

    def _dataset(self, split: str):
        if split not in self._datasets:
            dataset_cls, config_cls = _generators()[self.name]
            seed = self.seed + (EVAL_SEED_OFFSET if split == "eval" else 0)
            size = self.eval_size if split == "eval" else self.size
            try:
                config = config_cls(**self.config, seed=seed, size=size)
                config.validate()
            except (TypeError, ValueError, AssertionError) as err:
                raise ValueError(f"task.args.config_json: {self.name} refuses its arguments "
                                 f"({err or type(err).__name__})") from None
            self._datasets[split] = dataset_cls(config=config)
        return self._datasets[split]

    def _prompt(self, split: str, index: int) -> Prompt:
        question = self._dataset(split)[index]["question"]
        text = f"{question}\n\n{self.instruction}" if self.instruction else question
        return Prompt(prompt_id=f"{split[0]}{index}", text=text, answer=f"{split}:{index}")

    def prompts(self) -> Iterator[Prompt]:
        rng = random.Random(self.seed)  # nosec B311 # seeded data order, not security
        while True:
            order = list(range(self.size))
            rng.shuffle(order)
            for index in order:
                yield self._prompt("train", index)

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        return [self._prompt("eval", i) for i in range(min(num_prompts, self.eval_size))]

    def prompt_messages(self, prompt: Prompt) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt.text}]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """The generator's own score of the extracted answer (0-1)."""
        split, _, index_text = prompt.answer.partition(":")
        if split not in ("train", "eval") or not index_text.isascii() or not index_text.isdigit():
            raise ValueError(f"prompt answer {prompt.answer[:40]!r} is not a split:index")
        dataset = self._dataset(split)
        index = int(index_text)
        if index >= len(dataset):
            raise ValueError(f"prompt index {index} is beyond the {split} split")
        # The boxed answer where there is one; else the response itself, which the
        # generator's scorer reads its own way (some answers are words or lists).
        answer = last_boxed(response_text)
        if answer is None:
            answer = response_text.strip()
        return float(dataset.score_answer(answer, entry=dataset[index]))

    def final_answer(self, prompt: Prompt, response_text: str) -> str | None:
        """The boxed answer in canonical form, for maj@k's vote; a response without
        one casts no vote (the scorer's own reading of free text is its own)."""
        answer = last_boxed(response_text)
        return canonical_answer(answer) if answer is not None else None
