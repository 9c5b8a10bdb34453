"""The built-in task `agent`: math problems solved by an agent program that calls
the policy through an OpenAI-compatible chat endpoint, trained as one trajectory
per episode (the rollout side: reflow.rollout.agent_episode).

The dataset side and the default reward are the `math` task's: problems from a
local file under the datasets root, the final assistant message scored with
math-verify. With `reward_source: agent` the agent's own report counts instead
(a last stdout line `{"reward": x}`), and the reference answer is handed to it.

Agents are programs, and a job spec comes over the network: it only *names* an
agent, which must be registered on the service that runs it. The names are

- entry points in group `reflow.agents` that the operator installed, each value
  a module run as `python -m <module>`, and
- `*.py` scripts in the directory REFLOW_AGENTS_DIR (an operator setting of the
  rollout worker and the scheduler, never a spec's), each named by its stem; a
  script whose real path leaves the directory (a symlink out) is not registered.

An entry point wins over a script of the same name. A name that is not
registered is refused at submission (`check`) naming `task.args.agent` and the
names that are. This module knows nothing of engines, endpoints or processes:
it says which argv an agent name stands for, where its code lives (what an
isolated agent must see, reflow.rollout.agent_process) and what it is given.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from reflow.tasks.base import EpisodeLimits, Prompt, TaskContext
from reflow.tasks.math import MathTask

logger = logging.getLogger(__name__)

AGENT_GROUP = "reflow.agents"
AGENTS_DIR_ENV = "REFLOW_AGENTS_DIR"
# What an agent's name and an entry point's module may look like: nothing a
# path or a shell could read differently.
AGENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class AgentProgram:
    """A registered agent: its name and the argv that runs it (this interpreter,
    then `-m module` or the script's real path)."""

    name: str
    argv: tuple[str, ...]

    def code_paths(self) -> list[str]:
        """Where the agent's code lives, for a view that must show it: the script's
        directory, or the directories of the entry point's top-level package
        (site-packages, or an editable install's source). Found without importing it."""
        if self.argv[1] != "-m":
            return [os.path.dirname(self.argv[1])]
        try:
            spec = importlib.util.find_spec(self.argv[2].split(".")[0])
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return []
        if spec.submodule_search_locations:
            return [str(p) for p in spec.submodule_search_locations]
        return [spec.origin] if spec.origin and os.path.isabs(spec.origin) else []


def _entry_point_agents() -> dict[str, AgentProgram]:
    found: dict[str, AgentProgram] = {}
    for ep in entry_points(group=AGENT_GROUP):
        if not AGENT_NAME.match(ep.name) or not MODULE_NAME.match(ep.value):
            logger.warning("agent entry point %r = %r is not a name = module; ignored",
                           ep.name, ep.value)
            continue
        found.setdefault(ep.name, AgentProgram(ep.name, (sys.executable, "-m", ep.value)))
    return found


def _script_agents(directory: str) -> dict[str, AgentProgram]:
    root = Path(directory).resolve()
    if not root.is_dir():
        logger.warning("%s=%s is not a directory; no agent scripts", AGENTS_DIR_ENV, directory)
        return {}
    found: dict[str, AgentProgram] = {}
    for path in sorted(root.glob("*.py")):
        real = path.resolve()
        if not AGENT_NAME.match(path.stem) or not real.is_relative_to(root) or not real.is_file():
            continue
        found[path.stem] = AgentProgram(path.stem, (sys.executable, str(real)))
    return found


def registered_agents() -> dict[str, AgentProgram]:
    """Every agent this process may run, by name: the installed entry points, then
    the operator's scripts (read at each call, so a script added is seen)."""
    scripts = _script_agents(os.environ[AGENTS_DIR_ENV]) if os.environ.get(AGENTS_DIR_ENV) else {}
    return {**scripts, **_entry_point_agents()}


def resolve_agent(name: str, field: str = "task.args.agent") -> AgentProgram:
    """The registered agent `name`; ValueError naming `field` and the registered names."""
    agents = registered_agents()
    if name not in agents:
        names = ", ".join(sorted(agents)) or (f"none (install an entry point in group "
                                              f"{AGENT_GROUP!r} or set {AGENTS_DIR_ENV})")
        raise ValueError(f"{field}: unknown agent {name[:64]!r}; registered: {names}")
    return agents[name]


class AgentTask(MathTask):
    """Math problems posed to an agent program. The rollout worker plays each
    sample as one agent episode (`agent`); `multi_turn` gives the task the
    episode treatment everywhere else (no reward pool of the service's, the
    chat renderer, the group built from episodes)."""

    multi_turn: ClassVar[bool] = True
    agent: ClassVar[bool] = True

    class Args(MathTask.Args):
        agent: str = Field(min_length=1, max_length=64,
                           description="The agent program, by registered name (an entry point "
                           "in group `reflow.agents`, or a script in the operator's "
                           "REFLOW_AGENTS_DIR); never a path.")
        reward_source: Literal["task", "agent"] = Field(
            default="task", description="`task`: math-verify scores the final assistant "
            "message; `agent`: the agent's last stdout line `{\"reward\": x}` (the agent is "
            "given the reference answer).")
        retokenization: Literal["refuse", "keep_sampled"] = Field(
            default="keep_sampled", description="A call whose rendered history has the text of the "
            "tokens generated so far but other tokens (a sampled tokenization that is not the "
            "tokenizer's own, as `\\n` `\\n` for `\\n\\n`): `refuse` ends the episode "
            "(`agent_retokenized`); `keep_sampled` goes on from the tokens as sampled, so the "
            "trajectory stays what the engine saw (the default: at temperature 1 SmolLM2 "
            "samples such a tokenization in about 1 episode of 5). Another text is refused "
            "either way.")
        max_calls: int = Field(default=8, ge=1, le=256,
                               description="Chat-completion calls an episode may make; the "
                               "next one ends it (finish reason `length`).")
        max_episode_tokens: int = Field(default=4096, ge=16, le=262_144,
                                        description="Tokens after the first call's prompt: "
                                        "every completion and everything the agent added "
                                        "between them; each call's max_tokens is clamped to "
                                        "what is left.")
        episode_timeout_s: float = Field(default=300.0, gt=0.0, le=7200.0,
                                         description="Wall-clock seconds an agent may run; then "
                                         "its process group is killed (`agent_timeout`).")
        max_request_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20,
                                       description="Largest request body the endpoint reads "
                                       "(413 beyond).")
        memory_bytes: int = Field(default=4 << 30, ge=256 << 20, le=64 << 30,
                                  description="Address space each of the agent's processes "
                                  "may map (RLIMIT_AS); an allocation past it fails.")
        max_processes: int = Field(default=64, ge=4, le=1024,
                                   description="Processes and threads the agent may hold at "
                                   "once, itself included (RLIMIT_NPROC in a user namespace "
                                   "of its own).")

    def __init__(self, agent: str, reward_source: str = "task",
                 retokenization: str = "keep_sampled", max_calls: int = 8,
                 max_episode_tokens: int = 4096, episode_timeout_s: float = 300.0,
                 max_request_bytes: int = 1 << 20, memory_bytes: int = 4 << 30,
                 max_processes: int = 64, context: TaskContext | None = None,
                 **math_args: Any) -> None:
        # The agent is looked up where it runs (the rollout worker) and at submission,
        # not here: a reward process builds this task with an environment of its own.
        self.args = self.Args(agent=agent, reward_source=reward_source,
                              retokenization=retokenization, max_calls=max_calls,
                              max_episode_tokens=max_episode_tokens,
                              episode_timeout_s=episode_timeout_s,
                              max_request_bytes=max_request_bytes,
                              memory_bytes=memory_bytes, max_processes=max_processes,
                              **math_args)
        self.context = context or TaskContext()
        super().__init__(context=self.context, **math_args)

    @classmethod
    def check(cls, args: Args, context: TaskContext) -> None:
        """At submission: the agent is registered, the dataset is readable."""
        resolve_agent(args.agent)
        super().check(args, context)

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(max_turns=self.args.max_calls,
                             max_episode_tokens=self.args.max_episode_tokens,
                             turn_timeout_s=self.args.episode_timeout_s,
                             episode_timeout_s=self.args.episode_timeout_s)

    def agent_input(self, prompt: Prompt) -> dict[str, Any]:
        """What the agent reads on stdin, as JSON: the problem as text and as chat
        messages, and the reference answer only when the agent scores itself."""
        given: dict[str, Any] = {"prompt_id": prompt.prompt_id, "text": prompt.text,
                                 "messages": self.prompt_messages(prompt)}
        if self.args.reward_source == "agent":
            given["answer"] = prompt.answer
        return given
