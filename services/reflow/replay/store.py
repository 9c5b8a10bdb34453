"""The replay buffer's state, all of it in Redis (paper §4.2).

Owns the Redis data layout and the atomic operations on it: put a group,
lease a batch, release a lease, return expired leases, publish a policy
version. It knows nothing of gRPC; `server.py` exposes it.

Unit of sampling: the GRPO group. Rollout puts whole groups (their
advantages are normalised within the group at completion), and a batch is
made of whole groups, so every advantage in a batch was computed against the
same peers it was generated with.

Delivery is at-least-once: `lease` moves groups from the unused queue into a
lease with a deadline; `release` deletes them; a lease past its deadline goes
back to the queue at its original position. A buffer process can die at any
point and lose nothing: every transition is one Lua script, atomic in Redis.

Layout, per job, under `reflow:{<job>}:` (the braces keep a job's keys in one
Redis Cluster hash slot):

    samples         HASH  sample_id -> Trajectory protobuf bytes
    group_members   HASH  group_id  -> "sid,sid,..."
    group_seq       HASH  group_id  -> arrival number (FIFO order)
    unused          ZSET  group_id scored by arrival number
    leases          ZSET  lease_id scored by expiry (unix seconds)
    lease:<id>      STRING "gid,gid,..."
    stats           HASH  counters (see BufferStats)
    version         STRING latest published policy version
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import redis

from reflow.core.types import Batch, Trajectory
from reflow.wire import trajectory_from_bytes, trajectory_to_bytes

logger = logging.getLogger(__name__)

# KEYS: samples, group_members, group_seq, unused, stats
# ARGV: group_id, n, sid_1, bytes_1, ..., sid_n, bytes_n
_PUT_GROUP = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local n = tonumber(ARGV[2])
local ids = {}
for i = 1, n do
  local sid = ARGV[1 + 2 * i]
  redis.call('HSET', KEYS[1], sid, ARGV[2 + 2 * i])
  ids[#ids + 1] = sid
end
local seq = redis.call('HINCRBY', KEYS[5], 'arrivals', 1)
redis.call('HSET', KEYS[2], ARGV[1], table.concat(ids, ','))
redis.call('HSET', KEYS[3], ARGV[1], seq)
redis.call('ZADD', KEYS[4], seq, ARGV[1])
redis.call('HINCRBY', KEYS[5], 'put_total', n)
redis.call('HINCRBY', KEYS[5], 'unused_samples', n)
return n
"""

# KEYS: unused, group_members, leases, lease_key, stats
# ARGV: batch_size, lease_id, expiry
_LEASE = """
local want = tonumber(ARGV[1])
local gids = redis.call('ZRANGE', KEYS[1], 0, want - 1)
local taken = {}
local n = 0
for _, gid in ipairs(gids) do
  if n >= want then break end
  local members = redis.call('HGET', KEYS[2], gid)
  local _, commas = string.gsub(members, ',', '')
  taken[#taken + 1] = gid
  n = n + commas + 1
end
if n < want then return false end
redis.call('ZREM', KEYS[1], unpack(taken))
redis.call('SET', KEYS[4], table.concat(taken, ','))
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
redis.call('HINCRBY', KEYS[5], 'unused_samples', 0 - n)
redis.call('HINCRBY', KEYS[5], 'leased_samples', n)
return taken
"""

# KEYS: samples, group_members, group_seq, leases, lease_key, stats
# ARGV: lease_id
_RELEASE = """
local gids = redis.call('GET', KEYS[5])
if not gids then return 0 end
local n = 0
for gid in string.gmatch(gids, '[^,]+') do
  local members = redis.call('HGET', KEYS[2], gid)
  if members then
    for sid in string.gmatch(members, '[^,]+') do
      redis.call('HDEL', KEYS[1], sid)
      n = n + 1
    end
  end
  redis.call('HDEL', KEYS[2], gid)
  redis.call('HDEL', KEYS[3], gid)
end
redis.call('DEL', KEYS[5])
redis.call('ZREM', KEYS[4], ARGV[1])
if n > 0 then
  redis.call('HINCRBY', KEYS[6], 'trained_total', n)
  redis.call('HINCRBY', KEYS[6], 'leased_samples', 0 - n)
end
return n
"""

# KEYS: group_members, group_seq, unused, leases, stats
# ARGV: now, lease key prefix
_EXPIRE = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', ARGV[1])
local returned = 0
for _, lid in ipairs(expired) do
  local gids = redis.call('GET', ARGV[2] .. lid)
  if gids then
    for gid in string.gmatch(gids, '[^,]+') do
      local members = redis.call('HGET', KEYS[1], gid)
      if members then
        local _, commas = string.gsub(members, ',', '')
        returned = returned + commas + 1
        redis.call('ZADD', KEYS[3], redis.call('HGET', KEYS[2], gid), gid)
      end
    end
    redis.call('DEL', ARGV[2] .. lid)
  end
  redis.call('ZREM', KEYS[4], lid)
  redis.call('HINCRBY', KEYS[5], 'expired_leases_total', 1)
end
-- Guarded: Lua prints a negated zero as "-0", which Redis rejects.
if returned > 0 then
  redis.call('HINCRBY', KEYS[5], 'unused_samples', returned)
  redis.call('HINCRBY', KEYS[5], 'leased_samples', 0 - returned)
end
return returned
"""


@dataclass
class BufferStats:
    unused_samples: int = 0
    leased_samples: int = 0
    policy_version: int = 0
    put_total: int = 0
    trained_total: int = 0
    expired_leases_total: int = 0
    outstanding_leases: int = 0


class ReplayStore:
    """Replay-buffer operations for any number of jobs on one Redis."""

    def __init__(self, client: redis.Redis, poll_interval_s: float = 0.02) -> None:
        self.redis = client
        self.poll_interval_s = poll_interval_s
        self._put = client.register_script(_PUT_GROUP)
        self._lease = client.register_script(_LEASE)
        self._release = client.register_script(_RELEASE)
        self._expire = client.register_script(_EXPIRE)

    @classmethod
    def from_url(cls, url: str) -> ReplayStore:
        return cls(redis.Redis.from_url(url))

    @staticmethod
    def _key(job_id: str, name: str) -> str:
        if not job_id:
            raise ValueError("job_id must be non-empty")
        return f"reflow:{{{job_id}}}:{name}"

    def put(self, job_id: str, trajectories: list[Trajectory]) -> int:
        """Store trajectories, grouped by group_id. Putting a group twice is a no-op,
        so rollout may retry a put it is unsure of. Returns the samples accepted."""
        groups: dict[str, list[Trajectory]] = {}
        for t in trajectories:
            groups.setdefault(t.group_id, []).append(t)
        k = lambda name: self._key(job_id, name)  # noqa: E731
        keys = [k("samples"), k("group_members"), k("group_seq"), k("unused"), k("stats")]
        accepted = 0
        for group_id, members in groups.items():
            args: list[str | bytes | int] = [group_id, len(members)]
            for t in members:
                if "," in t.sample_id or "," in group_id:
                    raise ValueError("sample_id and group_id must not contain ','")
                args += [t.sample_id, trajectory_to_bytes(t)]
            accepted += int(self._put(keys=keys, args=args))
        return accepted

    def expire_leases(self, job_id: str, now: float | None = None) -> int:
        """Return samples of every lease past its deadline to the unused queue."""
        k = lambda name: self._key(job_id, name)  # noqa: E731
        keys = [k("group_members"), k("group_seq"), k("unused"), k("leases"), k("stats")]
        now = time.time() if now is None else now
        returned = int(self._expire(keys=keys, args=[now, k("lease:")]))
        if returned:
            logger.warning("job %s: %d samples returned from expired leases", job_id, returned)
        return returned

    def try_lease(self, job_id: str, batch_size: int, lease_ttl_s: float) -> Batch | None:
        """Lease `batch_size` samples (whole groups) if that many are unused, else None."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.expire_leases(job_id)
        lease_id = uuid.uuid4().hex
        k = lambda name: self._key(job_id, name)  # noqa: E731
        keys = [k("unused"), k("group_members"), k("leases"), k(f"lease:{lease_id}"), k("stats")]
        group_ids = self._lease(keys=keys, args=[batch_size, lease_id, time.time() + lease_ttl_s])
        if not group_ids:
            return None
        members = self.redis.hmget(k("group_members"), group_ids)
        sample_ids = [sid for m in members if m for sid in m.decode().split(",")]
        blobs = self.redis.hmget(k("samples"), sample_ids)
        trajectories = [trajectory_from_bytes(b) for b in blobs if b is not None]
        return Batch(lease_id=lease_id, trajectories=trajectories, policy_version=self.version(job_id))

    def lease(
        self, job_id: str, batch_size: int, lease_ttl_s: float, timeout_s: float
    ) -> Batch | None:
        """Like `try_lease`, waiting up to `timeout_s` for enough samples."""
        deadline = time.monotonic() + timeout_s
        while True:
            batch = self.try_lease(job_id, batch_size, lease_ttl_s)
            if batch is not None or time.monotonic() >= deadline:
                return batch
            time.sleep(self.poll_interval_s)

    def release(self, job_id: str, lease_id: str) -> int:
        """Finish a lease: its samples are trained and leave the buffer. Idempotent:
        an unknown or already released lease releases nothing."""
        k = lambda name: self._key(job_id, name)  # noqa: E731
        keys = [
            k("samples"),
            k("group_members"),
            k("group_seq"),
            k("leases"),
            k(f"lease:{lease_id}"),
            k("stats"),
        ]
        return int(self._release(keys=keys, args=[lease_id]))

    def return_lease(self, job_id: str, lease_id: str) -> int:
        """Give a lease's samples back at once, as if it had expired (used when the
        batch could not be delivered)."""
        self.redis.zadd(self._key(job_id, "leases"), {lease_id: 0}, xx=True)
        return self.expire_leases(job_id)

    def publish_version(self, job_id: str, policy_version: int) -> None:
        if policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {policy_version}")
        self.redis.set(self._key(job_id, "version"), policy_version)

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
        return BufferStats(
            unused_samples=counters.get("unused_samples", 0),
            leased_samples=counters.get("leased_samples", 0),
            policy_version=int(version) if version is not None else 0,
            put_total=counters.get("put_total", 0),
            trained_total=counters.get("trained_total", 0),
            expired_leases_total=counters.get("expired_leases_total", 0),
            outstanding_leases=int(leases),
        )
