"""The replay buffer's Redis transitions, each one atomic Lua script.

Key names are passed in KEYS in the order documented above each script; see
`reflow.replay.store` for the layout. Lua numbers are doubles: a negated zero
prints as "-0", which Redis rejects as an integer, so counter decrements are
written `0 - n` and skipped when n is 0.
"""

# Shared helper: number of members of a group ("sid,sid,...").
_SIZE = """
local function group_size(members_key, gid)
  local m = redis.call('HGET', members_key, gid)
  if not m then return 0 end
  local _, commas = string.gsub(m, ',', '')
  return commas + 1
end
local function bump(stats, field, n)
  if n ~= 0 then redis.call('HINCRBY', stats, field, n) end
end
local function drop_group(samples, sample_meta, members, meta, seq, by_version, gid)
  local m = redis.call('HGET', members, gid)
  if m then
    for sid in string.gmatch(m, '[^,]+') do
      redis.call('HDEL', samples, sid)
      redis.call('HDEL', sample_meta, sid)
    end
  end
  redis.call('HDEL', members, gid)
  redis.call('HDEL', meta, gid)
  redis.call('HDEL', seq, gid)
  redis.call('ZREM', by_version, gid)
end
"""

# KEYS: samples, members, meta, seq, unused, by_version, stats, version, sample_meta
# ARGV: group_id, meta, oldest_version, max_staleness, n, then per sample: sid, bytes, sample meta
# A group arriving already too stale is counted as put and evicted at once.
PUT_GROUP = _SIZE + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local n = tonumber(ARGV[5])
local version = tonumber(redis.call('GET', KEYS[8]) or '0')
bump(KEYS[7], 'put_total', n)
if tonumber(ARGV[3]) < version - tonumber(ARGV[4]) then
  bump(KEYS[7], 'evicted_total', n)
  bump(KEYS[7], 'evicted_unused_total', n)
  return n
end
local ids = {}
for i = 0, n - 1 do
  local sid = ARGV[6 + 3 * i]
  redis.call('HSET', KEYS[1], sid, ARGV[7 + 3 * i])
  redis.call('HSET', KEYS[9], sid, ARGV[8 + 3 * i])
  ids[#ids + 1] = sid
end
local seq = redis.call('HINCRBY', KEYS[7], 'arrivals', 1)
redis.call('HSET', KEYS[2], ARGV[1], table.concat(ids, ','))
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[4], ARGV[1], seq)
redis.call('ZADD', KEYS[5], seq, ARGV[1])
redis.call('ZADD', KEYS[6], ARGV[3], ARGV[1])
bump(KEYS[7], 'unused_samples', n)
return n
"""

# KEYS: unused, replay, members, leases, lease_key, stats
# ARGV: lease_id, expiry, num_unused, gid..., (then replay gids)
# Fails (returns 0) without changing anything if any group left its pool
# since the caller looked; the caller then composes again.
CLAIM = _SIZE + """
local nu = tonumber(ARGV[3])
for i = 4, #ARGV do
  local pool = (i - 3 <= nu) and KEYS[1] or KEYS[2]
  if not redis.call('ZSCORE', pool, ARGV[i]) then return 0 end
end
local taken_u, taken_r = 0, 0
for i = 4, #ARGV do
  local gid = ARGV[i]
  local size = group_size(KEYS[3], gid)
  if i - 3 <= nu then
    redis.call('ZREM', KEYS[1], gid)
    redis.call('HSET', KEYS[5], gid, 'u')
    taken_u = taken_u + size
  else
    redis.call('ZREM', KEYS[2], gid)
    redis.call('HSET', KEYS[5], gid, 'r')
    taken_r = taken_r + size
  end
end
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
bump(KEYS[6], 'unused_samples', 0 - taken_u)
bump(KEYS[6], 'replay_samples', 0 - taken_r)
bump(KEYS[6], 'leased_samples', taken_u + taken_r)
return 1
"""

# KEYS: samples, members, meta, seq, replay, by_version, leases, lease_key, stats, version,
#       sample_meta
# ARGV: lease_id, max_staleness, retire (1: replay is off, every sample leaves as
#       trained), then per group: gid, kept "sid,..." (may be ""), new meta
# Returns samples released, or -1 when the lease is unknown (released or expired).
RELEASE = _SIZE + """
if redis.call('EXISTS', KEYS[8]) == 0 then return -1 end
local version = tonumber(redis.call('GET', KEYS[10]) or '0')
local min_version = version - tonumber(ARGV[2])
local retire = ARGV[3] == '1'
local decisions = {}
for i = 4, #ARGV, 3 do decisions[ARGV[i]] = {ARGV[i + 1], ARGV[i + 2]} end
local released = 0
local lease = redis.call('HGETALL', KEYS[8])
for j = 1, #lease, 2 do
  local gid, kind = lease[j], lease[j + 1]
  local size = group_size(KEYS[2], gid)
  released = released + size
  bump(KEYS[9], 'leased_samples', 0 - size)
  bump(KEYS[9], 'trained_total', size)
  if kind == 'u' then bump(KEYS[9], 'trained_unused_total', size) end
  local oldest = tonumber(redis.call('ZSCORE', KEYS[6], gid) or '0')
  local d = decisions[gid]
  if retire then
    bump(KEYS[9], 'retired_total', size)
    drop_group(KEYS[1], KEYS[11], KEYS[2], KEYS[3], KEYS[4], KEYS[6], gid)
  elseif oldest < min_version then
    bump(KEYS[9], 'evicted_total', size)
    drop_group(KEYS[1], KEYS[11], KEYS[2], KEYS[3], KEYS[4], KEYS[6], gid)
  elseif d == nil or d[1] == '' then
    bump(KEYS[9], 'dropped_total', size)
    drop_group(KEYS[1], KEYS[11], KEYS[2], KEYS[3], KEYS[4], KEYS[6], gid)
  else
    local keep, kept = {}, 0
    for sid in string.gmatch(d[1], '[^,]+') do keep[sid] = true; kept = kept + 1 end
    for sid in string.gmatch(redis.call('HGET', KEYS[2], gid), '[^,]+') do
      if not keep[sid] then
        redis.call('HDEL', KEYS[1], sid)
        redis.call('HDEL', KEYS[11], sid)
      end
    end
    bump(KEYS[9], 'dropped_total', size - kept)
    redis.call('HSET', KEYS[2], gid, d[1])
    redis.call('HSET', KEYS[3], gid, d[2])
    redis.call('ZADD', KEYS[5], redis.call('HGET', KEYS[4], gid), gid)
    bump(KEYS[9], 'replay_samples', kept)
  end
end
redis.call('DEL', KEYS[8])
redis.call('ZREM', KEYS[7], ARGV[1])
return released
"""

# KEYS: members, seq, unused, replay, leases, stats
# ARGV: now, lease key prefix
# Every lease past its deadline gives its groups back to the pools they came from.
EXPIRE = _SIZE + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', ARGV[1])
local back_u, back_r = 0, 0
for _, lid in ipairs(expired) do
  local lease = redis.call('HGETALL', ARGV[2] .. lid)
  for j = 1, #lease, 2 do
    local gid, kind = lease[j], lease[j + 1]
    local size = group_size(KEYS[1], gid)
    local seq = redis.call('HGET', KEYS[2], gid)
    if size > 0 and seq then
      if kind == 'u' then
        redis.call('ZADD', KEYS[3], seq, gid); back_u = back_u + size
      else
        redis.call('ZADD', KEYS[4], seq, gid); back_r = back_r + size
      end
    end
  end
  redis.call('DEL', ARGV[2] .. lid)
  redis.call('ZREM', KEYS[5], lid)
  bump(KEYS[6], 'expired_leases_total', 1)
end
bump(KEYS[6], 'unused_samples', back_u)
bump(KEYS[6], 'replay_samples', back_r)
bump(KEYS[6], 'leased_samples', 0 - back_u - back_r)
return back_u + back_r
"""

# KEYS: samples, members, meta, seq, unused, replay, by_version, stats, version, sample_meta
# ARGV: policy_version, max_staleness
# Publishes the next version, current + 1; a version already reached (a retry
# after a lost reply, expire_leases' sweep) leaves it as it is. Either way it
# evicts every pooled group whose oldest segment is older than version -
# max_staleness (paper §4.2); leased groups are judged when their lease is
# released or expires. A version past the next is refused before anything is
# written: one call cannot jump the version (and age every sample out).
# Returns {1, evicted}, or {0, current} when refused.
PUBLISH = _SIZE + """
local current = tonumber(redis.call('GET', KEYS[9]) or '0')
local wanted = tonumber(ARGV[1])
if wanted > current + 1 then return {0, current} end
local version = current
if wanted == current + 1 then
  version = wanted
  redis.call('SET', KEYS[9], version)
end
local threshold = version - tonumber(ARGV[2])
local stale = redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', '(' .. threshold)
local evicted = 0
for _, gid in ipairs(stale) do
  local field = nil
  if redis.call('ZREM', KEYS[5], gid) == 1 then field = 'unused_samples'
  elseif redis.call('ZREM', KEYS[6], gid) == 1 then field = 'replay_samples' end
  if field then
    local size = group_size(KEYS[2], gid)
    bump(KEYS[8], field, 0 - size)
    if field == 'unused_samples' then bump(KEYS[8], 'evicted_unused_total', size) end
    evicted = evicted + size
    drop_group(KEYS[1], KEYS[10], KEYS[2], KEYS[3], KEYS[4], KEYS[7], gid)
  end
end
bump(KEYS[8], 'evicted_total', evicted)
return {1, evicted}
"""

# KEYS: stats
# ARGV: want, group_size, outstanding_limit, version_limit
# Grants up to `want` samples of dispatch, in whole groups (paper §4.1 step 1), under
# two bounds, both refunded by evictions of samples never trained on:
#   outstanding = dispatched - trained_unused - evicted_unused <= outstanding_limit
#   dispatched - evicted_unused <= version_limit (B_max per step up to the caller's
#   policy version plus its look-ahead)
# Returns the samples granted (0 when neither bound leaves a whole group).
DISPATCH = """
local function get(f) return tonumber(redis.call('HGET', KEYS[1], f) or '0') end
local dispatched = get('dispatched_total')
local evicted = get('evicted_unused_total')
local outstanding = dispatched - get('trained_unused_total') - evicted
local room = math.min(tonumber(ARGV[1]), tonumber(ARGV[3]) - outstanding,
                      tonumber(ARGV[4]) - (dispatched - evicted))
local group = tonumber(ARGV[2])
room = math.floor(room / group) * group
if room <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'dispatched_total', room)
return room
"""
