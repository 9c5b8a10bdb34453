"""The built-in multi-turn task `guess_number`: find a secret integer in
[1, max_number] from "higher" / "lower" feedback.

It exists to exercise multi-turn training with any model: a policy that
guesses badly still plays several turns (up to `max_turns`, at least 3), each
observation depends on the previous action, and the reward separates solving
from not solving and fast from slow. Bisection solves [1, N] in
ceil(log2(N + 1)) guesses (7 for N = 100).

Reward, summed over the episode's turns (T = max_turns, t = the turn that
finds the secret, 1-based):

    0.1 / T                  for every turn with a parseable guess in range
    0.9 * (T - t + 1) / T    on the turn that finds the secret

A first-turn hit earns 0.9 + 0.1 / T; a hit on the last turn after T valid
guesses earns 0.1 + 0.9 / T, still more than any miss (at most 0.1); the total
stays in [0, 1]. A turn without a readable guess is answered with a reminder of
the format and earns nothing; it still uses up a guess.
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from reflow.tasks.base import Prompt, StepResult
from reflow.tasks.env import EnvTask, answer_number, episode_answer, episode_seed

FORMAT_REWARD = 0.1
SOLVE_REWARD = 0.9


def parse_guess(text: str) -> int | None:
    """The integer a turn guesses: the last `\\boxed{}`, else the last number;
    None if that is not an integer (or absurdly long)."""
    found = answer_number(text)
    if found is None or len(found) > 12:
        return None
    try:
        value = float(found)
    except ValueError:
        return None
    return int(value) if value.is_integer() else None


class GuessNumberEnv:
    """One game: the secret is fixed by the episode seed."""

    def __init__(self, secret: int, max_number: int, max_turns: int, intro: str) -> None:
        self.secret, self.max_number, self.max_turns = secret, max_number, max_turns
        self.intro = intro
        self.turn = 0
        self.done = False

    def reset(self) -> str:
        self.turn, self.done = 0, False
        return self.intro

    def step(self, action: str) -> StepResult:
        if self.done:
            return StepResult(observation="The game is over.", done=True)
        self.turn += 1
        guess = parse_guess(action)
        turns_left = self.max_turns - self.turn
        info: dict[str, Any] = {"turn": self.turn, "guess": guess}
        if guess is None or not 1 <= guess <= self.max_number:
            reward = 0.0
            feedback = (f"I could not read a guess between 1 and {self.max_number}. Reply with "
                        "one integer, for example \\boxed{" f"{(1 + self.max_number) // 2}" "}.")
        else:
            reward = FORMAT_REWARD / self.max_turns
            if guess == self.secret:
                self.done = True
                reward += SOLVE_REWARD * (self.max_turns - self.turn + 1) / self.max_turns
                return StepResult(observation=f"Correct! The number was {self.secret}.",
                                  reward=reward, done=True, info={**info, "solved": True})
            feedback = f"{guess} is too {'low' if guess < self.secret else 'high'}: the number " \
                       f"is {'higher' if guess < self.secret else 'lower'}."
        if turns_left <= 0:
            self.done = True
            return StepResult(observation=f"{feedback} No guesses left; it was {self.secret}.",
                              reward=reward, done=True, info={**info, "solved": False})
        plural = "es" if turns_left > 1 else ""
        return StepResult(observation=f"{feedback} {turns_left} guess{plural} left.",
                          reward=reward, info=info)


class GuessNumberTask(EnvTask):
    system_prompt = ("You are playing a guessing game. Think briefly, then give your guess "
                     "as \\boxed{N}.")

    class Args(EnvTask.Args):
        max_turns: int = Field(default=7, ge=3, le=64,
                               description="Guesses an episode allows (at least 3, so every "
                               "episode that misses plays 3 turns or more).")
        max_number: int = Field(default=100, ge=2, le=1_000_000,
                                description="The secret lies in [1, max_number].")

    args: Args

    def episode_prompt(self, prompt_id: str, episode_seed: int) -> Prompt:
        secret = self._secret(episode_seed)
        return Prompt(prompt_id=prompt_id, text=self._intro(),
                      answer=episode_answer(episode_seed, secret=secret))

    def environment(self, prompt: Prompt) -> GuessNumberEnv:
        return GuessNumberEnv(self._secret(episode_seed(prompt)), self.args.max_number,
                              self.args.max_turns, self._intro())

    def _secret(self, seed: int) -> int:
        return random.Random(seed).randint(1, self.args.max_number)  # nosec B311 # a game

    def _intro(self) -> str:
        n, turns = self.args.max_number, self.args.max_turns
        return (f"I am thinking of an integer between 1 and {n}. Guess it: after each guess "
                f"I will tell you whether the number is higher or lower. You have {turns} "
                "guesses. Answer each turn with one integer as \\boxed{N}.")
