"""The algorithm's section of the job spec: which policy loss, how its tokens
are aggregated, which advantage estimator, how off-policy tokens are corrected
(paper §4.1 step 3), dynamic sampling and over-long responses.

A loss and an advantage estimator are plug-ins by registered name
(core/plugins.py, kinds `policy_loss` and `advantage`); their code lives in
`reflow.algorithms`. This module only names and bounds the choices.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from reflow.core import plugins
from reflow.core.sections import PluginArgs, _Section

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


class AlgorithmConfig(_Section):
    """The objective the trainer optimises and the data it accepts."""

    loss: str = Field(
        default="grpo", min_length=1, max_length=128,
        description="Policy loss, a registered name: `grpo` (PPO's clipped token ratio, "
        "symmetric clip), `dapo` (clip-higher: ε_high 0.28 unless set), `dr_grpo` (sums "
        "token losses over a constant, advantages without the std division), `gspo` (one "
        "ratio per sequence, the geometric mean of its tokens'; set trainer.clip_eps and "
        "algorithm.clip_eps_high to GSPO's 3e-4 and 4e-4), `cispo` (the ratio capped at 1 + "
        "ε_high as a stop-gradient weight on every token's log-probability); operators add more as "
        "entry points in group `reflow.policy_losses`.")
    loss_args: PluginArgs = Field(
        default_factory=dict,
        description="Keyword arguments for the loss, checked against its own Args model.")
    loss_aggregation: Aggregation | None = Field(
        default=None,
        description="How token losses become the step's loss: `token_mean` (every loss "
        "token of the batch counts once: DAPO, TRL's default), `seq_mean_token_mean` (each "
        "sequence's token mean, then the mean over sequences: the original GRPO), "
        "`seq_mean_token_sum_norm` (each sequence's token sum over a constant, "
        "`algorithm.aggregation_tokens`, then the mean over sequences: Dr.GRPO). None: the "
        "loss's own default.")
    aggregation_tokens: int | None = Field(
        default=None, ge=1, le=1_048_576,
        description="The constant of `seq_mean_token_sum_norm`. None: the longest response "
        "the spec allows (rollout.max_tokens, or the curriculum's longest).")
    clip_eps_high: float | None = Field(
        default=None, gt=0.0, le=10.0,
        description="ε_high: the upper clip of the ratio, 1 + ε_high (DAPO's clip-higher). "
        "None: the loss's default (dapo 0.28, cispo 0.28: its weight's cap), else "
        "trainer.clip_eps (ε, the lower clip, 1 - ε).")
    advantage: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="Advantage estimator, a registered name: `grpo` (reward minus the "
        "group mean, over the group's population std), `grpo_sample_std` (over the sample "
        "std, as TRL), `mean_centered` (no std division: Dr.GRPO), `rloo` (reward minus the "
        "mean of the group's other members); operators add more in group "
        "`reflow.advantages`. None: the loss's own pairing (dr_grpo: mean_centered; "
        "otherwise grpo).")
    proximal: Literal["behaviour", "recompute", "interpolate"] = Field(
        default="behaviour",
        description="The policy the ratio is clipped against (decoupled PPO, AReaL). "
        "`behaviour`: the log-probs the engine sampled with (verl's bypass mode). "
        "`recompute`: the trainer's own log-probs under the weights at the start of the "
        "step, and the behaviour mismatch corrected by importance weights "
        "(`importance_mode`). With one optimizer step per batch these are the step's own "
        "forward, detached: no extra pass. `interpolate`: AReaL's approximation of that "
        "proximal from each token's policy version (log-linear between behaviour and "
        "current), for trainer.num_minibatches > 1 where the recompute costs a forward pass.")
    importance_mode: Literal["off", "raw", "truncate", "mask"] = Field(
        default="off",
        description="Weights proximal ÷ behaviour on the loss, with `proximal` recompute or "
        "interpolate: `raw` (unbounded), `truncate` (at most `importance_cap`: TIS), "
        "`mask` (tokens or sequences whose weight lies outside [importance_floor, "
        "importance_cap] leave the loss: MIS). `off`: no weight.")
    importance_level: Literal["token", "sequence", "geometric"] = Field(
        default="token",
        description="Where the weight is taken: per token, per sequence (the product of "
        "its tokens' ratios), or per sequence as their geometric mean.")
    importance_cap: float = Field(
        default=2.0, gt=1.0, le=1e6,
        description="C: the upper bound of an importance weight (truncate, mask).")
    importance_floor: float | None = Field(
        default=None, ge=0.0, lt=1.0,
        description="The lower bound of `mask`. None: 1 / importance_cap.")
    dynamic_sampling: bool = Field(
        default=False,
        description="Drop GRPO groups whose scored rewards are all equal (within 1e-9; "
        "fewer than two scored members count as equal) before any batch holds them (DAPO's "
        "dynamic sampling): they carry no advantage. The dispatcher draws another prompt in "
        "each one's place on the same dispatch grant, so batches stay full; drops are "
        "counted (`filtered_groups` in the step records).")
    overlong: Literal["keep", "mask", "penalty"] = Field(
        default="keep",
        description="Responses at the length limit (the max_tokens a group was generated "
        "under, a length curriculum's stage where one applies; a multi-turn task's episode "
        "token budget): `keep` (trained like any other), `mask` (one cut at the limit, "
        "finish_reason `length`, leaves the loss but stays in its group's baseline: DAPO's "
        "overlong filtering), `penalty` (DAPO's soft over-length punishment, added to every "
        "scored response's reward by its length before the advantages: 0 up to "
        "`overlong_buffer_tokens` before the limit, then falling linearly to "
        "-`overlong_penalty` at it).")
    overlong_buffer_tokens: int = Field(
        default=16, ge=1, le=131072,
        description="L_cache of the soft penalty: the tokens before the limit over which "
        "the penalty rises.")
    overlong_penalty: float = Field(
        default=1.0, gt=0.0, le=100.0,
        description="The reward penalty at the length limit (with overlong=penalty).")

    @model_validator(mode="after")
    def _check(self) -> AlgorithmConfig:
        plugins.validate_args("policy_loss", self.loss, self.loss_args,
                              "algorithm.loss", "algorithm.loss_args")
        if self.advantage is not None:
            plugins.resolve("advantage", self.advantage, "algorithm.advantage")
        if self.proximal == "behaviour" and self.importance_mode != "off":
            raise ValueError(
                "algorithm.importance_mode: with algorithm.proximal=behaviour the proximal "
                "is the behaviour policy, so every weight is 1; set algorithm.proximal to "
                "recompute (or interpolate) to weight by proximal ÷ behaviour")
        if self.importance_floor is not None and self.importance_mode != "mask":
            raise ValueError("algorithm.importance_floor: only algorithm.importance_mode=mask "
                             "has a lower bound")
        return self

    @property
    def advantage_name(self) -> str:
        """The estimator in use: the spec's, or the loss's pairing."""
        return self.advantage or LOSS_ADVANTAGE.get(self.loss, "grpo")

    @property
    def importance_bounds(self) -> tuple[float, float]:
        """(floor, cap) of the importance weight."""
        floor = self.importance_floor
        return (1.0 / self.importance_cap if floor is None else floor), self.importance_cap


# The advantage estimator each built-in loss is published with (None in the spec
# picks it); a loss not listed pairs with grpo.
LOSS_ADVANTAGE = {"dr_grpo": "mean_centered"}
