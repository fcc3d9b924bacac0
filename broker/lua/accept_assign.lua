-- accept_assign.lua: on a single server, create a message record ROUTED to an instance and
-- assign it there, in one script: one round trip fewer between a message's arrival and its
-- instance. Everything accept.lua and assign.lua do, in their order; a record that exists
-- already is left alone (nothing assigned: its handling again re-applies what it needs).
-- A cluster keeps the two scripts: the record and the instance's keys are in other slots.
--
-- KEYS[1]  record    P:m:{id}
-- KEYS[2]  card      P:a:{inst}
-- KEYS[3]  inflight  P:f:{inst}
-- KEYS[4]  queue     P:q:{inst}
-- KEYS[5]  rate      P:r:instance:{inst}
-- KEYS[6]  due       the message's deadline set (broker/due_clock.py)
-- KEYS[7]  counters  P:counters (lua/count.lua), or absent: nothing counted
-- ARGV[1..12]  as accept.lua's, the next stage ROUTED and ARGV[9] the instance
-- ARGV[13] message id
-- ARGV[14] heartbeat age (ms) after which the instance counts as down
-- ARGV[15] the deadline entry's time (ms): the reaper's first look
-- ARGV[16] now (ms), as the script is sent: the time the credit and the rate are checked at
--          (ARGV[3], the acceptance time, was taken before the batch was planned)
-- ARGV[17..] more field, value pairs for the record
--
-- Returns {1, stage, attempt, assigned} for a new record, `assigned` being assign.lua's
-- answer (a refused one leaves the record ROUTED at attempt 1, for the caller to send back to
-- WAITING, as after assign.lua); {0, stage, attempt, 0} when the id exists.
local accepted = accept_record(KEYS[1], KEYS[7], ARGV, 17)
if accepted[1] == 0 then
  return {0, accepted[2], accepted[3], 0}
end
redis.call('ZADD', KEYS[6], ARGV[15], ARGV[13])
local assigned = assign_credit(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[13], '1', ARGV[16],
                               ARGV[14])
return {1, accepted[2], accepted[3], assigned}
