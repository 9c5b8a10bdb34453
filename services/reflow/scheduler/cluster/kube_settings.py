"""The Kubernetes backend's settings, from the scheduler pod's environment, and
the worker pods' label selector."""

from __future__ import annotations

import os
import re
import string

from pydantic import BaseModel, ConfigDict, Field, field_validator

_LABEL_KEY = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?")


DEFAULT_WORKER_ADDRESS = "{hostname}.{subdomain}.{namespace}.svc.cluster.local:{port}"
_ADDRESS_FIELDS = {"hostname", "subdomain", "namespace", "pod_ip", "port"}


class KubeSettings(BaseModel):
    """Read from the scheduler pod's environment (the chart sets every one)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(min_length=1, description="REFLOW_NAMESPACE: the release namespace.")
    worker_selector: str = Field(min_length=3, description="REFLOW_WORKER_SELECTOR: equality "
                                 "label selector of the worker pods, e.g. 'a=b,c=d'.")
    worker_port: int = Field(default=50060, ge=1, le=65535,
                             description="REFLOW_WORKER_PORT: the workers' gRPC port.")
    worker_address: str = Field(
        default=DEFAULT_WORKER_ADDRESS, min_length=3, max_length=512,
        description="REFLOW_WORKER_ADDRESS: how a worker pod is dialled, from its fields "
        "{hostname}, {subdomain} (the StatefulSet's headless Service), {namespace}, {pod_ip} "
        "and {port}. The default, its DNS name, stays the same when the pod is recreated at "
        "another IP; a pod without hostname and subdomain is dialled at its IP.")
    replay_address: str = Field(min_length=3, description="REFLOW_REPLAY_ADDRESS: host:port "
                                "of the replay-buffer service.")
    scheduler_selector: str = Field(default="", description="REFLOW_SCHEDULER_SELECTOR: "
                                    "equality label selector of the scheduler pods, among "
                                    "which the acting one carries the leader label.")
    max_rollout_workers: int = Field(default=0, ge=0, description="REFLOW_MAX_ROLLOUT_WORKERS: "
                                     "rollout workers per job; 0 takes every free worker.")
    health_timeout_s: float = Field(default=600.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0, le=300,
                                     description="REFLOW_KUBE_TIMEOUT_S: per API request.")
    resync_s: float = Field(default=30.0, ge=1, le=3600,
                            description="REFLOW_KUBE_RESYNC_S: the pod watch relists this often.")
    worker_rpc_timeout_s: float = Field(default=10.0, gt=0,
                                        description="Deadline of a worker status call.")
    stop_timeout_s: float = Field(default=90.0, gt=0,
                                  description="How long a released worker may take to go idle.")
    replace_timeout_s: float = Field(default=900.0, gt=0, le=86400,
                                     description="REFLOW_KUBE_REPLACE_TIMEOUT_S: how long a "
                                     "job waits for a lost worker pod to come back under its "
                                     "name (recreated, image pulled, model loaded) before it "
                                     "fails.")
    replace_with_idle_s: float = Field(default=120.0, ge=0, le=86400,
                                       description="REFLOW_KUBE_REPLACE_WITH_IDLE_S: how long "
                                       "a lost rollout pod is waited for before an idle "
                                       "worker pod takes its place in the job; 0: never.")
    claim_attempts: int = Field(default=5, ge=1, le=100,
                                description="Placements retried after a lost race, then the "
                                "job waits PENDING and tries again.")

    @field_validator("worker_address")
    @classmethod
    def _check_address(cls, value: str) -> str:
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
        except ValueError as err:
            raise ValueError(f"REFLOW_WORKER_ADDRESS: {err}") from None
        if not names <= _ADDRESS_FIELDS or "port" not in names:
            raise ValueError(f"REFLOW_WORKER_ADDRESS {value!r}: use only "
                             f"{', '.join('{' + f + '}' for f in sorted(_ADDRESS_FIELDS))}, "
                             "and {port}")
        return value

    @classmethod
    def from_env(cls) -> "KubeSettings":
        env = os.environ
        values: dict = {
            "namespace": env.get("REFLOW_NAMESPACE", ""),
            "worker_selector": env.get("REFLOW_WORKER_SELECTOR", ""),
            "replay_address": env.get("REFLOW_REPLAY_ADDRESS", ""),
        }
        for key, name in (("worker_port", "REFLOW_WORKER_PORT"),
                          ("scheduler_selector", "REFLOW_SCHEDULER_SELECTOR"),
                          ("worker_address", "REFLOW_WORKER_ADDRESS"),
                          ("max_rollout_workers", "REFLOW_MAX_ROLLOUT_WORKERS"),
                          ("request_timeout_s", "REFLOW_KUBE_TIMEOUT_S"),
                          ("resync_s", "REFLOW_KUBE_RESYNC_S"),
                          ("replace_timeout_s", "REFLOW_KUBE_REPLACE_TIMEOUT_S"),
                          ("replace_with_idle_s", "REFLOW_KUBE_REPLACE_WITH_IDLE_S")):
            if name in env:
                values[key] = env[name]
        return cls(**values)


def parse_selector(selector: str) -> dict[str, str]:
    """Equality-based selectors only (`k=v,k2=v2`): all the chart uses."""
    out = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = (part.strip() for part in term.partition("="))
        if not sep or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise ValueError(f"worker_selector: {term!r} is not 'key=value' with a valid label "
                             "key and value (only equality selectors are supported)")
        out[key] = value
    return out
