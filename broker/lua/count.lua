-- count.lua: prepended to the scripts that end or retry a message (broker/scripts.py), so a
-- count is written in the same script as the move it counts: exact under retries and crashes.
--
-- The counters are one hash (P:counters), field "<kind>\t<label>\t<label>..." -> count. Past
-- `max` distinct fields a new one counts under "<kind>\t~other": a producer naming a million
-- capabilities cannot grow it. No key given (metrics_counters off): nothing is counted.
--
-- A count never fails the script that counts: it comes after that script's writes (Redis
-- does not undo them), and a counters key someone spoiled (another type, a field that is no
-- number) would answer an error for a move that was made. Such a count is lost instead.
local function count_series(key, max, field)
  -- one command for a series that exists; a new one (its count is 1) is checked against
  -- the cap and, past it, moved under "~other"
  if redis.call('HINCRBY', key, field, 1) == 1 and redis.call('HLEN', key) > tonumber(max) then
    redis.call('HDEL', key, field)
    redis.call('HINCRBY', key, string.match(field, '^[^\t]*') .. '\t~other', 1)
  end
end

local function count_in(key, max, field)
  if key then
    pcall(count_series, key, max, field)
  end
end

