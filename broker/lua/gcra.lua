-- gcra.lua: take one call from a rate limit, or say how long until one conforms
-- (broker/gcra.py holds the rule and its proof; this is the same arithmetic).
--
-- KEYS[1]  the limit's state  P:r:<scope>:{<name>}  (string: the theoretical arrival time, ms)
-- ARGV[1]  now (ms)
-- ARGV[2]  emission interval (ms)
-- ARGV[3]  burst
--
-- Returns 0 when the call conforms (the state moves on), else the wait in whole ms (>= 1).
local now, interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tat = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if tat > now + (burst + 1) * interval then
  tat = now  -- no call leaves it there: written by a clock ahead of this caller's
end
local new_tat = math.max(tat, now) + interval
local over = new_tat - now - burst * interval
if over > 0.001 then  -- broker/gcra.py EPSILON_MS
  return math.max(1, math.ceil(over))
end
redis.call('SET', KEYS[1], string.format('%.3f', new_tat), 'PX', math.ceil(new_tat - now) + 1000)
return 0
