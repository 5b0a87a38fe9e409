-- RELEASE: the original article's release script, which checks the lease's owner: the lease
-- HASH must name the same key_id, provider and pool, else nothing is deleted and 0 comes back
-- (an expired lease already pruned, or a caller passing the wrong values); 1 means released, and
-- the credential's count of leases drops at once.
--
-- numkeys 0, as in the article.
-- ARGV[1]  provider
-- ARGV[2]  pool
-- ARGV[3]  key_id
-- ARGV[4]  lease_id
-- ARGV[5]  gap: the key prefix of the run (see allocate.lua); the article's names are global

local provider = ARGV[1]
local pool = ARGV[2]
local key_id = ARGV[3]
local lease_id = ARGV[4]
local prefix = ARGV[5]

local lease_hash = prefix .. "lease:" .. lease_id
local stored_key_id = redis.call("HGET", lease_hash, "key_id")
local stored_provider = redis.call("HGET", lease_hash, "provider")
local stored_pool = redis.call("HGET", lease_hash, "pool")
if stored_key_id ~= key_id or stored_provider ~= provider or stored_pool ~= pool then
  return 0
end
redis.call("DEL", lease_hash)
redis.call("ZREM", prefix .. "key:" .. key_id .. ":leases", lease_id)
return 1
