"""What every section of the job spec shares: unknown keys refused, assignments
validated, and the bounded shape of a plug-in's arguments."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Plug-in arguments: a few scalars. Bounded, so a spec cannot smuggle a megabyte
# of arguments into every service that parses it.
PluginArgs = Annotated[
    dict[Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")],
         bool | int | float | Annotated[str, StringConstraints(max_length=4096)]],
    Field(max_length=32),
]


class _Section(BaseModel):
    # NaN and infinity are refused as what they are ("finite number"), not by a bound
    # they fail to compare with.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
