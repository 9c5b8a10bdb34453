"""The plug-in registry: samplers, replay filters, tasks, policy losses and
advantage estimators, by registered name.

A job spec arrives from the network, so it may only *name* a plug-in; it never
says where code lives. The names a spec may use are:

- the built-ins below, and
- Python entry points that the operator installed into the image, one group per
  kind (`reflow.samplers`, `reflow.replay_filters`, `reflow.tasks`); see the
  example package under `examples/plugins/`.

Looking a name up imports nothing the spec chose: a name that is not registered
is refused before any import, and loading a registered one runs only code the
operator installed. A plug-in class declares its arguments as a pydantic model
in a class attribute `Args`; the spec's arguments are validated against it
(unknown keys refused) before the class is instantiated with them as keywords.

This module imports neither torch nor grpc, and knows nothing of what a
sampler, filter or task does: `reflow.replay.plugins` and `reflow.tasks` hold
the built-ins.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kind:
    """One kind of plug-in: its entry-point group and the method its classes must have."""

    name: str
    group: str
    methods: tuple[str, ...]


KINDS: dict[str, Kind] = {
    "sampler": Kind("sampler", "reflow.samplers", ("rank",)),
    "replay_filter": Kind("replay_filter", "reflow.replay_filters", ("keep",)),
    # A task also has `reward` (single-turn) or `environment` (multi-turn): reflow.tasks.
    "task": Kind("task", "reflow.tasks", ("prompts", "eval_prompts")),
    # reflow.algorithms: a policy loss scores tokens; an advantage estimator a group.
    "policy_loss": Kind("policy_loss", "reflow.policy_losses", ("token_terms",)),
    "advantage": Kind("advantage", "reflow.advantages", ("compute",)),
}

# Built-ins, as fixed references into this package (never taken from a spec).
BUILTINS: dict[str, dict[str, str]] = {
    "sampler": {
        "uniform": "reflow.replay.plugins:UniformSampler",
        "fifo": "reflow.replay.plugins:FifoSampler",
        "medium_reward": "reflow.replay.plugins:MediumRewardSampler",
    },
    "replay_filter": {
        "accept_all": "reflow.replay.plugins:AcceptAll",
        "max_use_count": "reflow.replay.plugins:MaxUseCount",
        "non_zero_advantage": "reflow.replay.plugins:NonZeroAdvantage",
    },
    "task": {
        "repeat": "reflow.tasks.repeat:RepeatTask",
        "math": "reflow.tasks.math:MathTask",
        "reasoning_gym": "reflow.tasks.gym:ReasoningGymTask",
        "guess_number": "reflow.tasks.games:GuessNumberTask",
        "calculator": "reflow.tasks.calculator:CalculatorTask",
        "python_tool": "reflow.tasks.python_tool:PythonToolTask",
        "code_tests": "reflow.tasks.code_tests:CodeTestsTask",
        "coding_agent": "reflow.tasks.coding_agent:CodingAgentTask",
        "agent": "reflow.tasks.agent:AgentTask",
    },
    "policy_loss": {
        "grpo": "reflow.algorithms.losses:GRPOLoss",
        "dapo": "reflow.algorithms.losses:DAPOLoss",
        "dr_grpo": "reflow.algorithms.losses:DrGRPOLoss",
        "gspo": "reflow.algorithms.losses:GSPOLoss",
        "cispo": "reflow.algorithms.losses:CISPOLoss",
    },
    "advantage": {
        "grpo": "reflow.algorithms.advantages:GroupNormalised",
        "grpo_sample_std": "reflow.algorithms.advantages:GroupNormalisedSampleStd",
        "mean_centered": "reflow.algorithms.advantages:MeanCentered",
        "rloo": "reflow.algorithms.advantages:LeaveOneOut",
    },
}


class NoArgs(BaseModel):
    """The arguments of a plug-in that takes none."""

    model_config = ConfigDict(extra="forbid")


def _kind(kind: str) -> Kind:
    if kind not in KINDS:
        raise KeyError(f"no plug-in kind {kind!r}; kinds are {', '.join(KINDS)}")
    return KINDS[kind]


@functools.cache
def _installed(kind: str) -> dict[str, EntryPoint]:
    """Entry points of this kind's group, read once per process from the installed
    distributions' metadata. A name that clashes with a built-in is ignored: an
    installed package cannot silently replace `uniform` under a spec's feet."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=_kind(kind).group):
        if ep.name in BUILTINS[kind]:
            logger.warning("plug-in %s %r from %s clashes with a built-in; ignored",
                           kind, ep.name, ep.value)
            continue
        found.setdefault(ep.name, ep)
    return found


def refresh() -> None:
    """Forget the entry points read so far (after installing a package in-process)."""
    _installed.cache_clear()


def registered(kind: str) -> list[str]:
    """Every name a spec may use for this kind, sorted."""
    return sorted({*BUILTINS[_kind(kind).name], *_installed(kind)})


def _unknown(kind: str, name: str, field: str) -> ValueError:
    hint = ""
    if ":" in name or "." in name:
        hint = (" (module paths are not accepted: an operator registers a plug-in as a "
                f"Python entry point in group {KINDS[kind].group!r})")
    return ValueError(f"{field}: unknown {kind.replace('_', ' ')} {name!r}{hint}; "
                      f"registered: {', '.join(registered(kind))}")


def resolve(kind: str, name: str, field: str | None = None) -> type:
    """The class registered as `name`. Only a registered name is ever loaded."""
    field = field or kind
    if name in BUILTINS[_kind(kind).name]:
        module_name, _, attr = BUILTINS[kind][name].partition(":")
        cls = getattr(importlib.import_module(module_name), attr)
    elif name in _installed(kind):
        try:
            cls = _installed(kind)[name].load()
        except Exception as err:  # noqa: BLE001 - an operator's broken install, named
            raise ValueError(f"{field}: plug-in {name!r} is registered but fails to load "
                             f"({type(err).__name__}: {err}); ask the operator") from None
    else:
        raise _unknown(kind, name, field)
    missing = [m for m in KINDS[kind].methods if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{field}: plug-in {name!r} is not a {kind} class "
                         f"(needs {', '.join(KINDS[kind].methods)})")
    return cls


def args_model(cls: type) -> type[BaseModel]:
    model = getattr(cls, "Args", NoArgs)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ValueError(f"plug-in {cls.__name__}: Args must be a pydantic model")
    return model


def validate_args(kind: str, name: str, args: dict[str, Any] | None, field: str,
                  args_field: str) -> BaseModel:
    """Check `args` against the plug-in's own `Args` model; nothing is instantiated.
    Errors name the field (`replay.filter_args.max_uses: ...`)."""
    model = args_model(resolve(kind, name, field))
    args = dict(args or {})
    unknown = sorted(set(args) - set(model.model_fields))
    if unknown:
        allowed = ", ".join(sorted(model.model_fields)) or "none"
        raise ValueError(f"{args_field}.{unknown[0]}: {name!r} takes no such argument; "
                         f"its arguments: {allowed}")
    try:
        return model.model_validate(args)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        where = f"{args_field}.{loc}" if loc else args_field
        raise ValueError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


def build(kind: str, name: str, args: dict[str, Any] | None = None, *, field: str | None = None,
          args_field: str | None = None, **context: Any) -> Any:
    """Validate the arguments, then instantiate the plug-in with them as keywords
    (plus `context`, keywords the caller supplies, such as a task's seed)."""
    field = field or kind
    validated = validate_args(kind, name, args, field, args_field or f"{field}_args")
    cls = resolve(kind, name, field)
    return cls(**dict(validated), **context)
