-- accept.lua: create a message record once per id, and take its first routing step.
--
-- KEYS[1]  record    P:m:{id}   (hash; its timeline in the field `timeline`, lua/timeline.lua)
-- KEYS[2]  counters  P:counters (hash, lua/count.lua), or absent: nothing counted
-- ARGV[1]  envelope JSON (completed: id, idempotency_key, created_at filled)
-- ARGV[2]  capability
-- ARGV[3]  now (ms)
-- ARGV[4]  deadline (ms)
-- ARGV[5]  reply_to, or ""
-- ARGV[6]  priority
-- ARGV[7]  timeline cap (entries)
-- ARGV[8]  next stage: "ROUTED", "WAITING", "REJECTED" or "FANNED_OUT" (a broadcast parent)
--          (ACCEPTED -> next, broker/stages.py)
-- ARGV[9]  instance, when next is ROUTED
-- ARGV[10] reason for the next step (for REJECTED also stored as the record's error)
-- ARGV[11] seconds to keep the record when next is terminal, or ""
-- ARGV[12] the counters' cap (distinct fields)
-- ARGV[13..] more field, value pairs for the record (the route decision, the wait reason)
--
-- A new record counts "accepted\t<capability>" (a broadcast's children too), or, REJECTED,
-- "finished\t<capability>\tREJECTED".
--
-- Returns {1, stage, attempt} for a new record, {0, stage, attempt} when the id exists
-- (a producer retry: the first acceptance wins and nothing else is written). The one
-- exception: an invalid envelope's rejection (field `invalid`) holds no id — a valid
-- envelope under that id replaces it, so a producer may fix and resend its envelope.
local rec = KEYS[1]
local existing = redis.call('HMGET', rec, 'stage', 'attempt', 'invalid')
if existing[1] then
  if not (existing[1] == 'REJECTED' and existing[3] == '1' and ARGV[8] ~= 'REJECTED') then
    return {0, existing[1], existing[2] or '0'}
  end
  redis.call('DEL', rec)
end
local attempt = ARGV[8] == 'ROUTED' and '1' or '0'
local error = ARGV[8] == 'REJECTED' and ARGV[10] or ''
redis.call('HSET', rec, 'envelope', ARGV[1], 'capability', ARGV[2], 'accepted_ms', ARGV[3],
           'deadline_ms', ARGV[4], 'reply_to', ARGV[5], 'priority', ARGV[6],
           'stage', ARGV[8], 'attempt', attempt, 'instance', ARGV[9], 'updated_ms', ARGV[3],
           'error', error, unpack(ARGV, 13))
timeline_append(rec, ARGV[7], {{ARGV[3], 'ACCEPTED', '', '0', ''},
                               {ARGV[3], ARGV[8], ARGV[9], attempt, ARGV[10]}})
if ARGV[8] == 'REJECTED' then
  count_in(KEYS[2], ARGV[12], 'finished\t' .. ARGV[2] .. '\tREJECTED')
else
  count_in(KEYS[2], ARGV[12], 'accepted\t' .. ARGV[2])
end
if ARGV[11] ~= '' then
  redis.call('EXPIRE', rec, ARGV[11])
end
return {1, ARGV[8], attempt}
