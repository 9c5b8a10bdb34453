"""The replay buffer's state and operations, all of it in Redis (paper §4).

Owns the Redis layout, batch composition under the replay cap σ, the
staleness bound δ, leases, and the replay filter's reinsertion. It knows
nothing of gRPC; `server.py` exposes it.

Unit of sampling: the GRPO group. Rollout puts whole groups, whose
advantages were normalised within the group when it completed; a batch is
made of whole groups, and a replayed group keeps the advantages it was
generated with (its members' ranking against each other does not change by
being reused). The replay filter decides per sample, so a group may come back
smaller; its remaining members keep their advantages.

Pools (paper §4.2): `unused` holds groups never trained on (fresh or stale),
`replay` holds groups trained on at least once and accepted back by the
filter. A batch of size b takes between ceil(b(1-σ)) and b samples from
`unused` and the rest from `replay`; how many it takes follows what is
available, so the replay fraction adapts to the rates of production and
consumption. With too few unused samples the request waits (up to its
deadline) rather than break the cap.

Delivery is at-least-once: `lease` moves groups into a lease with a deadline;
`release` applies the filter; an expired lease gives its groups back to the
pools they came from. Every transition is one Lua script (see `scripts.py`),
atomic in Redis, so a buffer process may die at any point and lose nothing.

Layout, per job, under `reflow:{<job>}:` (the braces keep a job's keys in one
Redis Cluster slot):

    samples      HASH sample_id -> Trajectory protobuf bytes
    sample_meta  HASH sample_id -> "reward|advantage|num_tokens|oldest_version" (for the filter)
    members      HASH group_id -> "sid,sid,..."
    meta         HASH group_id -> "size|reward_mean|oldest_version|uses|num_tokens|created_at"
    seq          HASH group_id -> arrival number (pool order)
    unused       ZSET group_id by arrival     replay  ZSET group_id by arrival
    by_version   ZSET group_id by oldest policy version (staleness index)
    leases       ZSET lease_id by expiry      lease:<id> HASH group_id -> u|r
    stats        HASH counters (see BufferStats)
    version      STRING latest published policy version (moves one at a time)
    config       STRING the job's ReplayConfig as JSON

and, for all jobs, `reflow:job_grants` (HASH job_id -> whether the buffer serves
the job: core/grants.py).
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from dataclasses import dataclass

import redis

from reflow import redisconn
from reflow.core.config import ReplayConfig, check_job_id
from reflow.core.errors import VersionGap
from reflow.core.grants import RedisGrants
from reflow.core.types import Batch, Trajectory, group_staleness_version
from reflow.replay import scripts
from reflow.replay.plugins import (
    GroupInfo, ReplayFilter, SampleInfo, Sampler, load_filter, load_sampler,
)
from reflow.wire import trajectory_from_bytes, trajectory_to_bytes

logger = logging.getLogger(__name__)

# Candidates read per pool per batch; larger pools are sampled at random.
MAX_CANDIDATES = 4096
_CLAIM_RETRIES = 5
# The JobSpec's own bounds on trainer.batch_size and replay.lease_ttl_s.
MAX_BATCH_SIZE = 65536
MAX_LEASE_TTL_S = 86_400.0
# The eviction window when ReplayConfig.evict_stale is off: no version is that old.
NO_EVICTION = 10**15
MAX_DISPATCH = 1 << 40


def staleness_window(config: ReplayConfig) -> int:
    """How many versions behind the latest a pooled sample may be (δ), or no bound
    when eviction is off (δ then only throttles dispatch)."""
    return config.max_staleness if config.evict_stale else NO_EVICTION


@dataclass
class BufferStats:
    unused_samples: int = 0
    replay_samples: int = 0
    leased_samples: int = 0
    policy_version: int = 0
    put_total: int = 0
    # Samples rollout was granted to generate (see ReplayStore.acquire_dispatch).
    dispatched_total: int = 0
    trained_total: int = 0
    trained_unused_total: int = 0
    # Samples that left for staleness (δ); of those, the ones never trained on
    # (wasted rollouts).
    evicted_total: int = 0
    evicted_unused_total: int = 0
    # Samples the replay filter did not keep, and (with σ = 0) trained samples retired.
    dropped_total: int = 0
    retired_total: int = 0
    expired_leases_total: int = 0
    outstanding_leases: int = 0


@dataclass
class RawBatch:
    """A leased batch as stored: protobuf bytes per sample, undecoded, so a server
    can pass them on without a round trip through Python objects."""

    lease_id: str
    policy_version: int
    samples: list[tuple[bytes, int]]  # (Trajectory bytes, uses before this batch)

    def decode(self) -> Batch:
        trajectories = []
        for blob, uses in self.samples:
            t = trajectory_from_bytes(blob)
            t.uses = uses
            trajectories.append(t)
        return Batch(self.lease_id, trajectories, self.policy_version)


def _meta(size: int, reward_mean: float, oldest: int, uses: int, tokens: int, created: float) -> str:
    return f"{size}|{reward_mean!r}|{oldest}|{uses}|{tokens}|{created!r}"


def _parse_meta(group_id: str, raw: bytes) -> GroupInfo:
    size, reward, oldest, uses, tokens, created = raw.decode().split("|")
    return GroupInfo(group_id, int(size), float(reward), int(oldest), int(uses), int(tokens),
                     float(created))


class ReplayStore:
    """Replay-buffer operations for any number of jobs on one Redis."""

    def __init__(self, client: redis.Redis, poll_interval_s: float = 0.02, seed: int | None = None) -> None:
        self.redis = client
        self.poll_interval_s = poll_interval_s
        self._rng = random.Random(seed)  # nosec B311 # replay sampling order, not security
        self._put = client.register_script(scripts.PUT_GROUP)
        self._claim = client.register_script(scripts.CLAIM)
        self._release = client.register_script(scripts.RELEASE)
        self._expire = client.register_script(scripts.EXPIRE)
        self._publish = client.register_script(scripts.PUBLISH)
        self._dispatch = client.register_script(scripts.DISPATCH)
        # The jobs the buffer serves, beside their data (the gRPC server checks
        # calls against them; end_job revokes).
        self.grants = RedisGrants(client)
        # Per job: the stored config's bytes, and the config and plug-ins built from
        # them, rebuilt only when the stored config changes.
        self._configs: dict[str, tuple[bytes, ReplayConfig, Sampler, ReplayFilter]] = {}

    @classmethod
    def from_url(cls, url: str, max_outage_s: float | None = None) -> ReplayStore:
        """A store on the Redis at `url`, whose commands ride out a Redis outage of
        up to `max_outage_s` (redisconn.py; None: its default) before they raise."""
        return cls(redisconn.connect(url, redisconn.MAX_OUTAGE_S if max_outage_s is None
                                     else max_outage_s))

    @staticmethod
    def _key(job_id: str, name: str) -> str:
        check_job_id(job_id)
        return f"reflow:{{{job_id}}}:{name}"

    def _keys(self, job_id: str, *names: str) -> list[str]:
        return [self._key(job_id, n) for n in names]

    # --- configuration ---------------------------------------------------------

    def configure(self, job_id: str, config: ReplayConfig) -> None:
        """Store the job's replay settings (σ, δ, plug-ins) where every buffer replica sees them."""
        self.redis.set(self._key(job_id, "config"), config.model_dump_json())

    def _job_settings(self, job_id: str) -> tuple[ReplayConfig, Sampler, ReplayFilter]:
        raw = self.redis.get(self._key(job_id, "config")) or b"{}"
        cached = self._configs.get(job_id)
        if cached is None or cached[0] != raw:
            config = ReplayConfig.model_validate_json(raw)
            cached = (raw, config, load_sampler(config.sampler, config.sampler_args),
                      load_filter(config.replay_filter, config.filter_args))
            self._configs[job_id] = cached
        return cached[1], cached[2], cached[3]

    def config(self, job_id: str) -> ReplayConfig:
        return self._job_settings(job_id)[0]

    # --- put ---------------------------------------------------------------------

    def put(self, job_id: str, trajectories: list[Trajectory]) -> int:
        """Store trajectories, grouped by group_id. Putting a group twice is a no-op,
        so rollout may retry a put it is unsure of. Returns the samples accepted."""
        groups: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            if "," in t.sample_id or "," in t.group_id or "|" in t.group_id:
                raise ValueError("sample_id and group_id must not contain ',' or '|'")
            groups.setdefault(t.group_id, []).append(t)
        config = self.config(job_id)
        delta = staleness_window(config)
        keys = self._keys(job_id, "samples", "members", "meta", "seq", "unused", "by_version",
                          "stats", "version", "sample_meta")
        pipe = self.redis.pipeline(transaction=False)
        for group_id, members in groups.items():
            # The group's version for δ, by the configured reference.
            version = group_staleness_version(members, config.staleness_version)
            meta = _meta(len(members), sum(t.reward for t in members) / len(members), version, 0,
                         sum(t.num_tokens for t in members), min(t.created_at for t in members))
            args: list[str | bytes | int] = [group_id, meta, version, delta, len(members)]
            for t in members:
                args += [t.sample_id, trajectory_to_bytes(t),
                         f"{t.reward!r}|{t.advantage!r}|{t.num_tokens}|"
                         f"{t.staleness_version(config.staleness_version)}"]
            self._put(keys=keys, args=args, client=pipe)
        return sum(int(n) for n in pipe.execute())

    # --- lease ---------------------------------------------------------------------

    def expire_leases(self, job_id: str, now: float | None = None) -> int:
        """Return the samples of every lease past its deadline to their pools."""
        keys = self._keys(job_id, "members", "seq", "unused", "replay", "leases", "stats")
        now = time.time() if now is None else now
        returned = int(self._expire(keys=keys, args=[now, self._key(job_id, "lease:")]))
        if returned:
            logger.warning("job %s: %d samples returned from expired leases", job_id, returned)
            # Returned groups may have aged past δ while leased.
            self.publish_version(job_id, self.version(job_id))
        return returned

    def renew_lease(self, job_id: str, lease_id: str, lease_ttl_s: float) -> bool:
        """Push a lease's deadline to now + lease_ttl_s, while the trainer still works on
        its batch. False when the lease is gone (released, or expired and returned)."""
        if not 0 < lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ValueError(f"lease_ttl_s: {lease_ttl_s} is out of range (0, {MAX_LEASE_TTL_S:.0f}]")
        # XX: only an existing lease; one command, so atomic against expiry and release.
        changed = self.redis.zadd(self._key(job_id, "leases"),
                                  {lease_id: time.time() + lease_ttl_s}, xx=True, ch=True)
        return bool(changed)

    def return_lease(self, job_id: str, lease_id: str) -> int:
        """Give a lease's samples back at once, as if it had expired (used when the
        batch could not be delivered)."""
        self.redis.zadd(self._key(job_id, "leases"), {lease_id: 0}, xx=True)
        return self.expire_leases(job_id)

    def return_all_leases(self, job_id: str) -> int:
        """Give every outstanding lease of the job back at once (its trainer died:
        the restarted one must not wait out the dead one's leases)."""
        key = self._key(job_id, "leases")
        leases = self.redis.zrange(key, 0, -1)
        if leases:
            self.redis.zadd(key, {lease: 0 for lease in leases}, xx=True)
        return self.expire_leases(job_id)

    def _candidates(self, job_id: str, pool: str, min_version: int) -> list[GroupInfo]:
        key = self._key(job_id, pool)
        if self.redis.zcard(key) <= MAX_CANDIDATES:
            ids = self.redis.zrange(key, 0, -1)
        else:
            ids = self.redis.zrandmember(key, MAX_CANDIDATES)
        if not ids:
            return []
        metas = self.redis.hmget(self._key(job_id, "meta"), ids)
        infos = [_parse_meta(g.decode(), m) for g, m in zip(ids, metas) if m is not None]
        return [g for g in infos if g.oldest_version >= min_version]

    @staticmethod
    def _take(ranked: list[GroupInfo], budget: int) -> list[GroupInfo]:
        taken, total = [], 0
        for g in ranked:
            if total + g.size <= budget:
                taken.append(g)
                total += g.size
            if total == budget:
                break
        return taken

    def try_lease(self, job_id: str, batch_size: int, lease_ttl_s: float) -> Batch | None:
        """Compose and lease a batch of `batch_size` samples now, or return None."""
        raw = self.try_lease_raw(job_id, batch_size, lease_ttl_s)
        return raw.decode() if raw is not None else None

    def try_lease_raw(self, job_id: str, batch_size: int, lease_ttl_s: float) -> RawBatch | None:
        """`try_lease`, returning the samples as stored bytes."""
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size: {batch_size} is out of range [1, {MAX_BATCH_SIZE}]")
        if not 0 < lease_ttl_s <= MAX_LEASE_TTL_S:
            raise ValueError(f"lease_ttl_s: {lease_ttl_s} is out of range (0, {MAX_LEASE_TTL_S:.0f}]")
        self.expire_leases(job_id)
        config, sampler, _ = self._job_settings(job_id)
        # σ bounds the replay share; ceil keeps the bound on the safe side.
        min_unused = math.ceil(batch_size * (1.0 - config.replay_cap) - 1e-9)
        for _ in range(_CLAIM_RETRIES):
            version = self.version(job_id)
            min_version = version - staleness_window(config)
            stats = self.stats(job_id)
            if stats.unused_samples < min_unused:
                return None
            unused = self._take(sampler.rank(self._candidates(job_id, "unused", min_version),
                                             self._rng), batch_size)
            num_unused = sum(g.size for g in unused)
            if num_unused < min_unused:
                return None
            replay: list[GroupInfo] = []
            if num_unused < batch_size:
                replay = self._take(sampler.rank(self._candidates(job_id, "replay", min_version),
                                                 self._rng), batch_size - num_unused)
                if num_unused + sum(g.size for g in replay) < batch_size:
                    return None
            lease_id = uuid.uuid4().hex
            keys = self._keys(job_id, "unused", "replay", "members", "leases", f"lease:{lease_id}",
                              "stats")
            args = [lease_id, time.time() + lease_ttl_s, len(unused),
                    *[g.group_id for g in unused], *[g.group_id for g in replay]]
            if self._claim(keys=keys, args=args):
                return self._load_batch(job_id, lease_id, unused + replay, version)
        return None

    def _load_batch(self, job_id: str, lease_id: str, groups: list[GroupInfo], version: int) -> RawBatch:
        members = self.redis.hmget(self._key(job_id, "members"), [g.group_id for g in groups])
        uses, sample_ids = [], []
        for g, m in zip(groups, members):
            for sid in (m or b"").decode().split(","):
                if sid:
                    sample_ids.append(sid)
                    uses.append(g.uses)
        blobs = self.redis.hmget(self._key(job_id, "samples"), sample_ids)
        return RawBatch(lease_id, version, list(zip(blobs, uses)))

    def lease_raw(self, job_id: str, batch_size: int, lease_ttl_s: float,
                  timeout_s: float) -> RawBatch | None:
        """Like `try_lease_raw`, waiting up to `timeout_s` for enough samples."""
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.try_lease_raw(job_id, batch_size, lease_ttl_s)
            if batch is not None or time.monotonic() >= deadline:
                return batch
            time.sleep(self.poll_interval_s)

    def lease(self, job_id: str, batch_size: int, lease_ttl_s: float, timeout_s: float) -> Batch | None:
        """Like `try_lease`, waiting up to `timeout_s` for enough samples."""
        raw = self.lease_raw(job_id, batch_size, lease_ttl_s, timeout_s)
        return raw.decode() if raw is not None else None

    # --- release -------------------------------------------------------------------

    def release(self, job_id: str, lease_id: str,
                sample_stats: dict[str, dict[str, float]] | None = None) -> int:
        """Finish a lease: its samples count as trained once more, and the replay
        filter decides, sample by sample, which go back to the replay pool.
        Idempotent: an unknown, released or expired lease releases nothing."""
        lease = self.redis.hgetall(self._key(job_id, f"lease:{lease_id}"))
        if not lease:
            return 0
        config, _, replay_filter = self._job_settings(job_id)
        group_ids = [g.decode() for g in lease]
        metas = self.redis.hmget(self._key(job_id, "meta"), group_ids)
        members = self.redis.hmget(self._key(job_id, "members"), group_ids)
        sample_stats = sample_stats or {}
        # With σ = 0 nothing can ever be replayed: trained samples simply leave.
        retire = config.replay_cap == 0.0
        args: list[str | int] = [lease_id, staleness_window(config), int(retire)]
        for gid, meta, m in zip(group_ids if not retire else [], metas, members):
            if meta is None or m is None:
                continue
            info = _parse_meta(gid, meta)
            sids = m.decode().split(",")
            kept: list[tuple[str, float, int]] = []
            for sid, raw in zip(sids, self.redis.hmget(self._key(job_id, "sample_meta"), sids)):
                if raw is None:
                    continue
                reward, advantage, tokens, oldest = raw.decode().split("|")
                sample = SampleInfo(sid, gid, float(reward), float(advantage), info.uses + 1,
                                    int(tokens), int(oldest), sample_stats.get(sid, {}))
                if replay_filter.keep(sample):
                    kept.append((sid, sample.reward, sample.num_tokens))
            meta_new = ""
            if kept:
                meta_new = _meta(len(kept), sum(r for _, r, _ in kept) / len(kept),
                                 info.oldest_version, info.uses + 1,
                                 sum(n for _, _, n in kept), info.created_at)
            args += [gid, ",".join(sid for sid, _, _ in kept), meta_new]
        keys = self._keys(job_id, "samples", "members", "meta", "seq", "replay", "by_version",
                          "leases", f"lease:{lease_id}", "stats", "version", "sample_meta")
        released = int(self._release(keys=keys, args=args))
        return max(released, 0)

    # --- dispatch accounting -----------------------------------------------------------

    def acquire_dispatch(self, job_id: str, want: int, group_size: int, outstanding_limit: int,
                         version_limit: int) -> int:
        """Grant rollout up to `want` samples to dispatch, in whole groups of `group_size`,
        counted against the job's one budget shared by all its rollout workers (paper
        §4.1 step 1). Outstanding samples (dispatched, not yet trained or evicted) stay
        within `outstanding_limit`; dispatched samples, less those evicted unused, within
        `version_limit` (B_max per step up to the caller's version plus its look-ahead).
        Evicted samples refund both; an expired lease's samples return to the pool and
        stay outstanding until trained or evicted. Returns the samples granted."""
        for name, value, low in (("want", want, 0), ("group_size", group_size, 1),
                                 ("outstanding_limit", outstanding_limit, 0),
                                 ("version_limit", version_limit, 0)):
            if not low <= value <= MAX_DISPATCH:
                raise ValueError(f"{name}: {value} is out of range [{low}, {MAX_DISPATCH}]")
        if want < group_size:
            return 0
        return int(self._dispatch(keys=[self._key(job_id, "stats")],
                                  args=[want, group_size, outstanding_limit, version_limit]))

    # --- versions and stats ----------------------------------------------------------

    def publish_version(self, job_id: str, policy_version: int) -> int:
        """Record the job's next policy version and evict what it makes too stale
        (δ). A version already reached (a retry after a lost reply) is accepted and
        leaves the version as it is; one past the next raises VersionGap, changing
        nothing: a single call cannot jump the version, which would age every
        pooled sample out at once and leave the job unable to catch up. Returns the
        samples evicted."""
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        keys = self._keys(job_id, "samples", "members", "meta", "seq", "unused", "replay",
                          "by_version", "stats", "version", "sample_meta")
        published, value = (int(x) for x in self._publish(
            keys=keys, args=[policy_version, staleness_window(self.config(job_id))]))
        if not published:
            raise VersionGap(
                f"policy_version: {policy_version} skips versions: job {job_id}'s buffer is at "
                f"version {value}, and a publish may only name the next one ({value + 1}) "
                "or one already published")
        if value:
            logger.info("job %s: version %d evicted %d stale samples", job_id, policy_version,
                        value)
        return value

    def end_job(self, job_id: str) -> None:
        """The job ended (the scheduler's EndJob): its passes are no longer taken
        here (core/grants.py). Its samples, counters and version stay: a stopped
        job may be resumed and keeps its buffer. Idempotent."""
        check_job_id(job_id)
        self.grants.revoke(job_id)

    def version(self, job_id: str) -> int:
        raw = self.redis.get(self._key(job_id, "version"))
        return int(raw) if raw is not None else 0

    def stats(self, job_id: str) -> BufferStats:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self._key(job_id, "stats"))
        pipe.get(self._key(job_id, "version"))
        pipe.zcard(self._key(job_id, "leases"))
        raw, version, leases = pipe.execute()
        counters = {key.decode(): int(value) for key, value in raw.items()}
        fields = {f: counters.get(f, 0) for f in BufferStats.__dataclass_fields__}
        fields["policy_version"] = int(version) if version is not None else 0
        fields["outstanding_leases"] = int(leases)
        return BufferStats(**fields)
