-- heartbeat.lua: a sidecar's heartbeat: time, state and live stats on its card.
--
-- KEYS[1]  card  P:a:{inst}  (hash)
-- ARGV[1]  instance id (the announcement)
-- ARGV[2]  now (ms)
-- ARGV[3]  the state the sidecar computed (UP / DEGRADED / DOWN)
-- ARGV[4]  channel to announce a change on
-- ARGV[5]  "1" to announce even without a state change (circuit or cooldown changed)
-- ARGV[6]  the sidecar process's incarnation (adapters/lifecycle.py), or "": none written
-- ARGV[7..] stats field, value pairs
--
-- DRAINING, once set (by the sidecar or an operator), is kept: a heartbeat never undoes it.
-- Returns {the state now on the card, the state before, the circuit before, the incarnation
-- before} (the caller reports a change as an event; an incarnation not its own means another
-- process wrote the card since its last beat), or false when the card is gone (deregistered).
local before = redis.call('HMGET', KEYS[1], 'state', 'circuit', 'incarnation')
local current = before[1]
if not current then
  return false
end
local state = ARGV[3]
if current == 'DRAINING' then
  state = 'DRAINING'
end
redis.call('HSET', KEYS[1], 'hb_ms', ARGV[2], 'state', state, unpack(ARGV, 7))
if ARGV[6] ~= '' then
  redis.call('HSET', KEYS[1], 'incarnation', ARGV[6])
end
if state ~= current or ARGV[5] == '1' then
  redis.call('PUBLISH', ARGV[4], ARGV[1])
end
-- (the incarnation cut: whoever may write the card may make it any size)
return {state, current, before[2] or '', string.sub(before[3] or '', 1, 200)}
