-- note.lua: append an event that changes no stage (CALLBACK_DELIVERED: the result reached the
-- producer's webhook) to a message's timeline, only while that timeline still exists: a
-- terminal record and its timeline expire together, and an RPUSH after that would re-create
-- a timeline that never expires.
--
-- KEYS[1]  timeline  P:t:{id}   (list of JSON [ts, stage, instance, attempt, reason])
-- KEYS[2]  record    P:m:{id}   (hash; its attempt and instance label the entry)
-- ARGV[1]  now (ms)
-- ARGV[2]  event name, written where a timeline entry holds its stage
-- ARGV[3]  reason for the timeline
-- ARGV[4]  timeline cap (entries)
--
-- Returns 1 when the event was appended, 0 when there is no timeline (expired, or unknown id).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local cur = redis.call('HMGET', KEYS[2], 'attempt', 'instance')
local attempt, instance = cur[1] or '0', cur[2] or ''
-- RPUSH and LTRIM keep the list's expiry: the event leaves with the rest of the record.
redis.call('RPUSH', KEYS[1], cjson.encode({ARGV[1], ARGV[2], instance, attempt, ARGV[3]}))
redis.call('LTRIM', KEYS[1], -tonumber(ARGV[4]), -1)
return 1
