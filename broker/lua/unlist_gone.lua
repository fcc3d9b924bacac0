-- unlist_gone.lua: take instances the janitor forgot (lua/forget_instance.lua) off the
-- registry's list, unless listed again since: a sidecar that registered under the same id
-- between the two steps (on a cluster the list is on another slot) keeps its place. A
-- plain ZREM there left a live, beating instance off the list for good (a beat never adds
-- one), and no dispatcher routed to it.
--
-- KEYS[1]  agents  P:agents  (sorted set: instance id -> last heard, ms)
-- ARGV[1]  listed before this (ms) is gone: now - instance_gone_after_s
-- ARGV[2..] the instances forgotten
--
-- Returns the instances now off the list (removed, or not listed at all).
local cutoff = tonumber(ARGV[1])
local gone = {}
for i = 2, #ARGV do
  local heard = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if not heard then
    gone[#gone + 1] = ARGV[i]
  elseif tonumber(heard) <= cutoff then  -- forget_instance.lua's own test: gone at the cutoff
    redis.call('ZREM', KEYS[1], ARGV[i])
    gone[#gone + 1] = ARGV[i]
  end
end
return gone
