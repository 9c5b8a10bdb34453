"""The dispatcher's ledger, in Redis beside the job's buffer: how far into the
task's prompt stream the job has got, and every group routed to a rollout
worker and not yet ended.

It is what lets a job go on after the services holding its groups are gone
without skipping or repeating a prompt (verl #4199 and NeMo-RL #3599 resumed
past the prompts in flight, biased toward the long ones): a dispatcher built
for a resumed job skips the stream to `position` and routes the groups still
in flight again first, under their own group ids, so a group that did reach
the buffer before the fault is not stored twice (the buffer's put is
idempotent per group id), and with the dispatch budget they were granted.

Layout, per job, under `reflow:{<job>}:` (the job's Redis Cluster slot):

    dispatch  HASH position -> prompts routed from the stream so far
    inflight  HASH group_id -> the group's prompt, JSON
"""

from __future__ import annotations

import json
import logging

import redis

from reflow.core.config import check_job_id
from reflow.tasks.base import Prompt

logger = logging.getLogger(__name__)

# A prompt as stored is at most this long (the rollout's own bound on a prompt
# and an answer, with room for the JSON around them).
MAX_ENTRY_BYTES = 1 << 20


class DispatchLedger:
    def __init__(self, client: redis.Redis, job_id: str) -> None:
        check_job_id(job_id)
        self.redis = client
        self._dispatch = f"reflow:{{{job_id}}}:dispatch"
        self._inflight = f"reflow:{{{job_id}}}:inflight"

    def routed(self, group_id: str, prompt: Prompt, from_stream: bool,
               replaces: str | None = None) -> None:
        """A group went to a worker; `from_stream`: its prompt was the stream's next
        (not one going out again), so the position moves past it; `replaces`: a
        group dynamic sampling dropped, whose grant this one spends, so it leaves
        in the same transaction (never both kept, never neither)."""
        entry = json.dumps({"prompt_id": prompt.prompt_id, "text": prompt.text,
                            "answer": prompt.answer})
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self._inflight, group_id, entry)
        if replaces is not None and replaces != group_id:
            pipe.hdel(self._inflight, replaces)
        if from_stream:
            pipe.hincrby(self._dispatch, "position", 1)
        pipe.execute()

    def ended(self, group_ids: list[str]) -> None:
        """Groups that were put, failed, or handed back (routed again under a new id).
        A group dynamic sampling dropped leaves with the route that spends its
        grant instead (`routed(..., replaces=)`)."""
        if group_ids:
            self.redis.hdel(self._inflight, *group_ids)

    def load(self) -> tuple[int, list[tuple[str, Prompt]]]:
        """The stream position and the groups in flight, oldest entries first as
        Redis returns them; a malformed entry is logged and dropped."""
        position = int(self.redis.hget(self._dispatch, "position") or 0)
        groups = []
        for gid, raw in self.redis.hgetall(self._inflight).items():
            try:
                if len(raw) > MAX_ENTRY_BYTES:
                    raise ValueError(f"{len(raw)} bytes")
                d = json.loads(raw)
                groups.append((gid.decode(), Prompt(str(d["prompt_id"]), str(d["text"]),
                                                    str(d["answer"]))))
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
                logger.error("dispatch ledger %s: dropping entry %r (%s)", self._inflight,
                             gid[:40], err)
        return position, groups
