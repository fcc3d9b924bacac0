-- accept_direct.lua: the direct lane (broker/direct.py): on a single server, a producer
-- creates the record of a message ROUTED to the instance its capability's lane names and
-- assigns it there, as accept_assign.lua does for a dispatcher — or does nothing at all,
-- and the producer sends the envelope to the ingress instead. Nothing is done unless the
-- lane still names the instance the producer read (the dispatcher withdraws it when the
-- capability gains a second instance, a limit, or waiting work), the instance's card lists
-- the capability (whoever wrote the lane), no work of the capability waits (it would be
-- overtaken), and the instance has a free credit now (the credit rule, assign_credit.lua).
-- The decision recorded is the dispatcher's, published with the lane.
--
-- KEYS[1]  record    P:m:{id}
-- KEYS[2]  card      P:a:{inst}
-- KEYS[3]  inflight  P:f:{inst}
-- KEYS[4]  queue     P:q:{inst}
-- KEYS[5]  rate      P:r:instance:{inst}
-- KEYS[6]  due       the message's deadline set (broker/due_clock.py)
-- KEYS[7]  lane      P:direct:{capability}
-- KEYS[8]  waiting   P:w:{capability}
-- KEYS[9]  aside     P:x:{capability}
-- KEYS[10] ingress   the ingress partition the envelope would otherwise go to
-- KEYS[11] counters  the lane's counters hash (lua/count.lua), or absent: nothing counted
-- ARGV[1..12]  as accept.lua's, the next stage ROUTED and ARGV[9] the instance; ARGV[3] and
--          ARGV[4] (accepted, deadline) are set here, from Redis's clock
-- ARGV[13] message id
-- ARGV[14] heartbeat age (ms) after which the instance counts as down (the lane's)
-- ARGV[15] the envelope's timeout (ms): its deadline is that long after its acceptance
-- ARGV[16] the delivery timeout (ms, the lane's): the reaper's first look, if sooner
-- ARGV[17] the instance the lane named when the producer read it (broker/direct_lane.py: the
--          lane is that id, a line break, its terms)
-- ARGV[18] the capability's assignment counter's name but for its window (P:n:{cap}:), a
--          key not declared: this script runs on a single server only
-- ARGV[19] the counter's window (ms), ARGV[20] seconds to keep it
-- ARGV[21] the dispatchers' consumer group on the ingress
-- ARGV[22..] more field, value pairs for the record (the lane's decision)
--
-- Returns {1} when the message is assigned; {0, stage, attempt} when its id names a record
-- already (nothing written: the ingress judges a request sent again); {-1, why} when the
-- lane may not be taken (nothing written, but for the lane itself: refused for want of a
-- credit, for the instance's state or for waiting work, it is deleted, so that what comes
-- next goes to the ingress behind what did, until a dispatcher publishes it again; refused
-- while the ingress holds an entry no dispatcher has finished with, it is kept: the check
-- itself holds what follows back until then).

-- Whether every entry of the ingress has been read and acknowledged by the dispatchers'
-- group: anything sent before this envelope, by anyone, is routed (recorded, assigned or
-- waiting) before it may pass (lua/group_backlog.lua reads the group).
local function ingress_settled(stream, group)
  if redis.call('EXISTS', stream) == 0 then
    return true
  end
  local pending, undelivered = group_backlog(stream, group, 1)
  if not pending then
    return redis.call('XLEN', stream) == 0  -- no dispatcher has read it yet
  end
  return pending == 0 and undelivered == 0
end

local lane = redis.call('GET', KEYS[7])
if not lane or string.sub(lane, 1, #ARGV[17] + 1) ~= ARGV[17] .. '\n' then
  return {-1, 'lane'}
end
local serves = redis.call('HGET', KEYS[2], 'capabilities')
if not serves or not string.find(',' .. serves .. ',', ',' .. ARGV[2] .. ',', 1, true) then
  return {-1, 'instance'}
end
if redis.call('ZCARD', KEYS[8]) > 0 or redis.call('ZCARD', KEYS[9]) > 0 then
  redis.call('DEL', KEYS[7])
  return {-1, 'waiting'}
end
if not ingress_settled(KEYS[10], ARGV[21]) then
  return {-1, 'ingress'}
end
-- a stream someone made another type refuses here, before anything is written
redis.call('XLEN', KEYS[4])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local verdict, new_tat = credit_verdict(KEYS[2], KEYS[3], KEYS[5], ARGV[13], '1', now, ARGV[14])
if verdict ~= 1 then
  redis.call('DEL', KEYS[7])
  return {-1, 'credit ' .. verdict}
end
local deadline = now + tonumber(ARGV[15])
ARGV[3] = tostring(now)
ARGV[4] = tostring(deadline)
local accepted = accept_record(KEYS[1], KEYS[11], ARGV, 22)
if accepted[1] == 0 then
  return {0, accepted[2], accepted[3]}
end
redis.call('ZADD', KEYS[6], math.min(deadline, now + tonumber(ARGV[16])), ARGV[13])
take_credit(KEYS[3], KEYS[4], KEYS[5], ARGV[13], '1', now, new_tat)
-- a statistic: a counter someone spoiled costs the count, never the assignment's answer
pcall(function()
  local counter = ARGV[18] .. math.floor(now / tonumber(ARGV[19]))
  redis.call('INCRBY', counter, 1)
  redis.call('EXPIRE', counter, ARGV[20])
end)
return {1}
