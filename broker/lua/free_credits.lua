-- free_credits.lua: prepended to the scripts that return a sidecar's credits (release.lua,
-- finish.lua; broker/scripts.py): one entry's credit freed and its entry acknowledged, and
-- the announcement of what is now in use.
local function free_credit(inflight, queue, group, member, entry_id)
  local freed = redis.call('SREM', inflight, member)
  redis.call('XACK', queue, group, entry_id)
  return freed
end

-- "<instance id> <credits now in use>" on the credit channel, SPUBLISH when `sharded` is "1"
local function announce_credits(inflight, channel, instance, sharded)
  local announcement = instance .. ' ' .. redis.call('SCARD', inflight)
  if sharded == '1' then
    redis.call('SPUBLISH', channel, announcement)
  else
    redis.call('PUBLISH', channel, announcement)
  end
end

