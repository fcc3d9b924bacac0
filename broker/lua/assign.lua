-- assign.lua: hand one message attempt to an instance, only against a free credit.
--
-- KEYS[1]  card      P:a:{inst}  (hash: state, credits, hb_ms, ...)
-- KEYS[2]  inflight  P:f:{inst}  (set of "id:attempt" = credits in use)
-- KEYS[3]  queue     P:q:{inst}  (stream read by the instance's sidecar)
-- KEYS[4]  rate      P:r:instance:{inst}  (the instance's GCRA state, broker/gcra.py), used
--          when the card has a rate (`rate_ms` > 0, `burst`: agent-reach sidecar --rate)
-- ARGV[1]  message id
-- ARGV[2]  attempt
-- ARGV[3]  now (ms)
-- ARGV[4]  heartbeat age (ms) after which the instance counts as down
--
-- Returns 1 assigned, 2 already assigned (a repeat of the same attempt), 0 no free credit,
-- -1 unknown instance, -2 instance not accepting work (DOWN / DRAINING), -3 heartbeat lapsed,
-- -4 over the instance's rate limit (checked with the credit, and taken only with it).
local card = redis.call('HMGET', KEYS[1], 'state', 'credits', 'hb_ms', 'rate_ms', 'burst')
if not card[1] then
  return -1
end
if card[1] ~= 'UP' and card[1] ~= 'DEGRADED' then
  return -2
end
if tonumber(ARGV[3]) - tonumber(card[3] or '0') > tonumber(ARGV[4]) then
  return -3
end
local member = ARGV[1] .. ':' .. ARGV[2]
if redis.call('SCARD', KEYS[2]) >= tonumber(card[2] or '0') then
  -- At the limit: a repeat of an assignment already made is still an answer of its own.
  return redis.call('SISMEMBER', KEYS[2], member) == 1 and 2 or 0
end
local interval = tonumber(card[4] or '0') or 0
local new_tat
if interval > 0 and KEYS[4] then
  if redis.call('SISMEMBER', KEYS[2], member) == 1 then
    return 2
  end
  local now = tonumber(ARGV[3])
  local burst = tonumber(card[5] or '1') or 1
  local tat = tonumber(redis.call('GET', KEYS[4]) or '0') or 0
  if tat > now + (burst + 1) * interval then
    tat = now  -- written by a clock ahead of this caller's (broker/gcra.py)
  end
  new_tat = math.max(tat, now) + interval
  if new_tat - now - burst * interval > 0.001 then
    return -4
  end
  redis.call('SET', KEYS[4], string.format('%.3f', new_tat), 'PX', math.ceil(new_tat - now) + 1000)
end
if redis.call('SADD', KEYS[2], member) == 0 then
  return 2
end
redis.call('XADD', KEYS[3], '*', 'id', ARGV[1], 'attempt', ARGV[2])
return 1
