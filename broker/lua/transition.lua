-- transition.lua: compare-and-set one message's stage, and append the move to its timeline.
--
-- KEYS[1]  record    P:m:{id}   (hash)
-- KEYS[2]  timeline  P:t:{id}   (list of JSON [ts, stage, instance, attempt, reason])
-- ARGV[1]  allowed source stages, comma-separated (from broker/stages.py)
-- ARGV[2]  expected attempt, or "" for any
-- ARGV[3]  expected instance, or "" for any
-- ARGV[4]  new stage
-- ARGV[5]  new attempt, "" to keep, or "+" for the current attempt plus one
-- ARGV[6]  new instance, or "" to keep
-- ARGV[7]  now (ms)
-- ARGV[8]  reason for the timeline
-- ARGV[9]  timeline cap (entries)
-- ARGV[10] seconds to keep record and timeline (set when the new stage is terminal), or ""
--          (then any expiry is removed: a replayed record lives until it ends anew)
-- ARGV[11] a record field to return on success, or ""
-- ARGV[12..] field, value pairs to write on success
--
-- Returns {1, stage, attempt, instance, returned_field} on success,
--         {0, stage, attempt, instance} when the record is not in an allowed state,
--         {-1} when there is no record.
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 'stage', 'attempt', 'instance', ARGV[11])
if not cur[1] then
  return {-1}
end
local stage, attempt, instance = cur[1], cur[2] or '0', cur[3] or ''
if not string.find(',' .. ARGV[1] .. ',', ',' .. stage .. ',', 1, true)
   or (ARGV[2] ~= '' and ARGV[2] ~= attempt)
   or (ARGV[3] ~= '' and ARGV[3] ~= instance) then
  return {0, stage, attempt, instance}
end
local new_attempt = attempt
if ARGV[5] == '+' then
  new_attempt = tostring(tonumber(attempt) + 1)
elseif ARGV[5] ~= '' then
  new_attempt = ARGV[5]
end
local new_instance = ARGV[6] ~= '' and ARGV[6] or instance
redis.call('HSET', rec, 'stage', ARGV[4], 'attempt', new_attempt, 'instance', new_instance,
           'updated_ms', ARGV[7], unpack(ARGV, 12))
-- A list, not a stream: a stream preallocates a whole node (4 KB) for its first entry.
redis.call('RPUSH', KEYS[2], cjson.encode({ARGV[7], ARGV[4], new_instance, new_attempt, ARGV[8]}))
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[9]), -1)
if ARGV[10] ~= '' then
  redis.call('EXPIRE', rec, ARGV[10])
  redis.call('EXPIRE', KEYS[2], ARGV[10])
elseif redis.call('PERSIST', rec) == 1 then
  -- out of a terminal stage again (an operator's replay): keep it until it ends anew
  redis.call('PERSIST', KEYS[2])
end
return {1, ARGV[4], new_attempt, new_instance, ARGV[11] ~= '' and cur[4] or false}
