"""Prometheus metrics of the trainer, one update per training step.
Names follow `reflow_trainer_<noun>_<unit>`; ratios are 0-1."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("reflow_trainer_step_seconds", "Training step time.", ["job_id"],
                                      buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
                                      registry=r)
        self.steps = Counter("reflow_trainer_steps_total", "Training steps taken.", ["job_id"], registry=r)
        self.tokens = Counter("reflow_trainer_trained_tokens_total", "Loss tokens trained on.",
                              ["job_id"], registry=r)
        self.tokens_per_s = Gauge("reflow_trainer_tokens_per_second",
                                  "Trained tokens over step time, last step.", ["job_id"], registry=r)
        self.trainer_idle = Gauge("reflow_trainer_idle_ratio",
                                  "Share of the last step spent waiting: for a batch, and for the "
                                  "rollout workers to pause for a weight update.", ["job_id"],
                                  registry=r)
        self.rollout_idle = Gauge("reflow_trainer_rollout_idle_ratio",
                                  "Share of the last step the rollout workers had nothing in flight.",
                                  ["job_id"], registry=r)
        self.rollout_utilisation = Gauge(
            "reflow_trainer_rollout_utilisation_ratio",
            "Rollout engines' batch occupancy over the last step (running requests over the "
            "concurrency cap), averaged over workers.", ["job_id"], registry=r)
        self.version = Gauge("reflow_trainer_policy_version", "Latest published policy version.",
                             ["job_id"], registry=r)
        self.sync_seconds = Histogram("reflow_trainer_weight_sync_seconds",
                                      "Time to publish weights to every rollout worker.", ["job_id"],
                                      buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
                                      registry=r)
        self.reward = Gauge("reflow_trainer_reward_mean", "Mean reward of the last batch.", ["job_id"],
                            registry=r)
        self.replay_fraction = Gauge("reflow_trainer_replay_fraction_ratio",
                                     "Replayed share of the last batch.", ["job_id"], registry=r)
        self.staleness = Gauge("reflow_trainer_max_staleness_versions",
                               "Largest policy lag in the last batch.", ["job_id"], registry=r)
        self.group_replicas = Gauge("reflow_trainer_group_replicas",
                                    "Trainer replicas the last step ran on (the data-parallel "
                                    "group, leader included).", ["job_id"], registry=r)
        self.reference_kl = Gauge("reflow_trainer_reference_kl_nats",
                                  "k3 estimate of KL(policy || frozen reference) per loss token, "
                                  "last step (0 without a KL penalty).", ["job_id"], registry=r)
        self.reference_bytes = Gauge("reflow_trainer_reference_model_bytes",
                                     "Parameter bytes of the frozen reference model the KL "
                                     "penalty holds (0 without one).", ["job_id"], registry=r)
        self.eval_reward = Gauge("reflow_trainer_eval_reward_mean",
                                 "Mean reward on the task's held-out split, latest evaluation "
                                 "(eval.interval).", ["job_id"], registry=r)
        self.eval_scores = Gauge("reflow_trainer_eval_score_ratio",
                                 "Latest evaluation's pass@1, pass@k and maj@k (maj@k only for "
                                 "tasks with a final answer; eval.k).", ["job_id", "metric"],
                                 registry=r)
        self.eval_version = Gauge("reflow_trainer_eval_policy_version",
                                  "Policy version the latest evaluation scored.", ["job_id"],
                                  registry=r)
        self.rollout_workers = Gauge("reflow_trainer_rollout_workers",
                                     "Rollout workers generating during the last step.",
                                     ["job_id"], registry=r)
        # trainer/checkpoint.py: one observation per committed checkpoint.
        self.checkpoint_bytes = Gauge("reflow_trainer_checkpoint_bytes",
                                      "Size on disk of the latest committed checkpoint.",
                                      ["job_id"], registry=r)
        self.checkpoint_write = Histogram(
            "reflow_trainer_checkpoint_write_seconds",
            "From a checkpoint's start to its commit marker (in the background).", ["job_id"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600), registry=r)
        self.checkpoint_stage = Histogram(
            "reflow_trainer_checkpoint_stage_seconds",
            "Time a checkpoint held the training step up (staging the state in memory).",
            ["job_id"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.checkpoints = Counter("reflow_trainer_checkpoints_total",
                                   "Checkpoints committed.", ["job_id"], registry=r)
        # reflow.tracking: experiment trackers fed from a background thread.
        self.tracker_errors = Counter(
            "reflow_trainer_tracker_errors_total",
            "Experiment tracker calls that raised (a tracker that failed to start counts one "
            "and is disabled).", ["backend"], registry=r)
        self.tracker_dropped = Counter(
            "reflow_trainer_tracker_dropped_records_total",
            "Records dropped because the experiment trackers' queue was full "
            "(tracking.queue_size).", registry=r)

    def tracker_error(self, backend: str) -> None:
        self.tracker_errors.labels(backend).inc()

    def tracker_drop(self) -> None:
        self.tracker_dropped.inc()

    def observe_checkpoint(self, job_id: str, size: int, write_s: float, stage_s: float) -> None:
        self.checkpoint_bytes.labels(job_id).set(size)
        self.checkpoints.labels(job_id).inc()
        self.checkpoint_write.labels(job_id).observe(write_s)
        self.checkpoint_stage.labels(job_id).observe(stage_s)

    def observe(self, job_id: str, record: dict[str, Any]) -> None:
        self.step_seconds.labels(job_id).observe(record["step_time_s"])
        self.steps.labels(job_id).inc()
        self.tokens.labels(job_id).inc(record["trained_tokens"])
        self.tokens_per_s.labels(job_id).set(record["trainer_tokens_per_s"])
        self.trainer_idle.labels(job_id).set(record["trainer_idle_ratio"])
        self.rollout_idle.labels(job_id).set(record["rollout_idle_ratio"])
        self.rollout_utilisation.labels(job_id).set(record.get("rollout_utilisation", 0.0))
        self.version.labels(job_id).set(record["policy_version"])
        if record["weight_sync_s"]:
            self.sync_seconds.labels(job_id).observe(record["weight_sync_s"])
        self.reward.labels(job_id).set(record["reward_mean"])
        self.replay_fraction.labels(job_id).set(record["replay_fraction"])
        self.staleness.labels(job_id).set(record["max_staleness"])
        self.group_replicas.labels(job_id).set(record.get("trainer_workers", 1))
        self.rollout_workers.labels(job_id).set(record.get("rollout_workers", 1))
        self.reference_kl.labels(job_id).set(record.get("kl", 0.0))
        if "eval_reward" in record:
            self.eval_reward.labels(job_id).set(record["eval_reward"])
            self.eval_version.labels(job_id).set(record["eval_policy_version"])
            for metric in ("pass_at_1", "pass_at_k", "maj_at_k"):
                if f"eval_{metric}" in record:
                    self.eval_scores.labels(job_id, metric).set(record[f"eval_{metric}"])
        self.reference_bytes.labels(job_id).set(record.get("reference_model_bytes", 0))
