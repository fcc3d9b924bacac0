-- count.lua: prepended to the scripts that end or retry a message (broker/scripts.py), so a
-- count is written in the same script as the move it counts: exact under retries and crashes.
--
-- The counters are one hash (P:counters), field "<kind>\t<label>\t<label>..." -> count. Past
-- `max` distinct fields a new one counts under "<kind>\t~other": a producer naming a million
-- capabilities cannot grow it. No key given (metrics_counters off): nothing is counted.
local function count_in(key, max, field)
  if not key then
    return
  end
  -- one command for a series that exists; a new one (its count is 1) is checked against
  -- the cap and, past it, moved under "~other"
  if redis.call('HINCRBY', key, field, 1) == 1 and redis.call('HLEN', key) > tonumber(max) then
    redis.call('HDEL', key, field)
    redis.call('HINCRBY', key, string.match(field, '^[^\t]*') .. '\t~other', 1)
  end
end

