-- note.lua: append an event that changes no stage (CALLBACK_DELIVERED: the result reached the
-- producer's webhook) to a message's timeline, only while its record still exists: a terminal
-- record expires with its timeline, and writing after that would re-create a record that
-- never expires.
--
-- KEYS[1]  record    P:m:{id}   (hash; its attempt and instance label the entry)
-- ARGV[1]  now (ms)
-- ARGV[2]  event name, written where a timeline entry holds its stage
-- ARGV[3]  reason for the timeline
-- ARGV[4]  timeline cap (entries)
--
-- Returns 1 when the event was appended, 0 when there is no record (expired, or unknown id).
local cur = redis.call('HMGET', KEYS[1], 'stage', 'attempt', 'instance')
if not cur[1] then
  return 0
end
-- HSET keeps the record's expiry: the event leaves with the rest of the record.
timeline_append(KEYS[1], ARGV[4], {{ARGV[1], ARGV[2], cur[3] or '', cur[2] or '0', ARGV[3]}})
return 1
