-- heartbeat.lua: a sidecar's heartbeat: time, state and live stats on its card.
--
-- KEYS[1]  card  P:a:{inst}  (hash)
-- ARGV[1]  instance id (the announcement)
-- ARGV[2]  now (ms)
-- ARGV[3]  the state the sidecar computed (UP / DEGRADED / DOWN)
-- ARGV[4]  channel to announce a change on
-- ARGV[5]  "1" to announce even without a state change (circuit or cooldown changed)
-- ARGV[6..] stats field, value pairs
--
-- DRAINING, once set (by the sidecar or an operator), is kept: a heartbeat never undoes it.
-- Returns {the state now on the card, the state before, the circuit before} (the caller
-- reports a change as an event), or false when the card is gone (deregistered).
local before = redis.call('HMGET', KEYS[1], 'state', 'circuit')
local current = before[1]
if not current then
  return false
end
local state = ARGV[3]
if current == 'DRAINING' then
  state = 'DRAINING'
end
redis.call('HSET', KEYS[1], 'hb_ms', ARGV[2], 'state', state, unpack(ARGV, 6))
if state ~= current or ARGV[5] == '1' then
  redis.call('PUBLISH', ARGV[4], ARGV[1])
end
return {state, current, before[2] or ''}
