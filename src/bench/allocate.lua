-- ALLOCATE: the original article's allocation script (reference: "Redis Lua 原子占位"), kept in
-- its structure: the candidate ZSET of the provider/pool as KEYS[1], a HASH per credential
-- (status, cooldown_until, max_concurrent_uses, last_used_at), a ZSET of lease ids scored by
-- their expiry per credential, a HASH per lease; the ranked ids come from the caller and the
-- first candidate that passes the three gates (still in the pool, usable, under its limit after
-- pruning its expired leases) is taken. Scoring is not in the script (the article keeps it in
-- the application on purpose).
--
-- The article's text lost its quotes and operators; they are filled back here. Where the bench
-- had to fill a gap of its own, a comment says "gap:".
--
-- KEYS[1]  {prefix}provider:{provider}:pool:{pool}:keys
-- ARGV[1]  now_ts, unix seconds (the caller's clock, as in the article)
-- ARGV[2]  lease_seconds, at least 1
-- ARGV[3]  provider
-- ARGV[4]  pool
-- ARGV[5]  lease_id (the caller generates it)
-- ARGV[6]  gap: the key prefix of the run. The article's names are global (key:{key_id},
--          lease:{lease_id}); the bench keeps each run's keys apart under a prefix, so the ranked
--          ids start at ARGV[7] instead of ARGV[6]
-- ARGV[7..] ranked key ids, best first
-- Returns the key_id taken, or nil: "this ranked list has no free slot now" (not an error).

local now_ts = tonumber(ARGV[1])
local lease_seconds = tonumber(ARGV[2])
local provider = ARGV[3]
local pool = ARGV[4]
local lease_id = ARGV[5]
local prefix = ARGV[6]
local provider_zset = KEYS[1]

-- key names are built by functions only, never spelt again in the script (the article's advice)
local function lease_hash(id)
  return prefix .. "lease:" .. id
end

-- gap: the article writes "key:" .. key_id inline in is_usable, max_concurrent_for and
-- mark_allocated; one function here, so the prefix is added in one place
local function key_hash(key_id)
  return prefix .. "key:" .. key_id
end

local function key_lease_zset(key_id)
  return key_hash(key_id) .. ":leases"
end

-- status says health only; rate_limited/cooldown with a cooldown_until in the past count as
-- usable (opportunistic recovery); an empty cooldown_until with those states does not
local function is_usable(key_id)
  local hash_key = key_hash(key_id)
  local status = redis.call("HGET", hash_key, "status")
  local cooldown_until = redis.call("HGET", hash_key, "cooldown_until")
  local usable = status == "available"
  if (status == "rate_limited" or status == "cooldown") and cooldown_until and cooldown_until ~= "" then
    local cooldown_ts = tonumber(cooldown_until)
    -- gap: the comparison lost its operator; "<=" (a cooldown ending now has ended), the same
    -- boundary as an expired lease (score <= now_ts is pruned below)
    usable = cooldown_ts and cooldown_ts <= now_ts
  end
  return usable
end

-- the crash insurance: leases whose expiry has passed are deleted before counting
local function prune_expired(key_id)
  local zset_key = key_lease_zset(key_id)
  local expired = redis.call("ZRANGEBYSCORE", zset_key, "-inf", now_ts)
  for _, expired_lease_id in ipairs(expired) do
    redis.call("DEL", lease_hash(expired_lease_id))
  end
  if #expired > 0 then
    redis.call("ZREMRANGEBYSCORE", zset_key, "-inf", now_ts)
  end
end

local function active_count_for(key_id)
  prune_expired(key_id)
  return redis.call("ZCARD", key_lease_zset(key_id))
end

-- missing, non-numeric or < 1 limits count as 1 (the article's conservative reading)
local function max_concurrent_for(key_id)
  local hash_key = key_hash(key_id)
  local value = tonumber(redis.call("HGET", hash_key, "max_concurrent_uses") or 1) or 1
  if value < 1 then
    return 1
  end
  return value
end

-- three writes: the lease in the credential's lease ZSET (scored by its expiry), the lease's
-- HASH (what release checks), and the credential's HASH back to available
local function mark_allocated(key_id)
  local expires_at = now_ts + lease_seconds
  redis.call("ZADD", key_lease_zset(key_id), expires_at, lease_id)
  redis.call("HSET", lease_hash(lease_id), "key_id", key_id, "provider", provider, "pool", pool,
    "lease_until", tostring(expires_at))
  redis.call("HSET", key_hash(key_id), "status", "available")
  redis.call("HSET", key_hash(key_id), "cooldown_until", "")
  redis.call("HSET", key_hash(key_id), "last_used_at", tostring(now_ts))
  return key_id
end

-- the main loop: the first candidate through the three gates is taken, the rest are not looked at
for i = 7, #ARGV do
  local key_id = ARGV[i]
  if redis.call("ZSCORE", provider_zset, key_id) then
    if is_usable(key_id) and active_count_for(key_id) < max_concurrent_for(key_id) then
      return mark_allocated(key_id)
    end
  end
end
return nil
