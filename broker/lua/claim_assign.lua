-- claim_assign.lua: on a single server, a drain's claim of a waiting message (transition.lua,
-- WAITING -> ROUTED at a new attempt) and its assignment (assign.lua), in one script; the
-- deadline entry brought forward to the delivery timeout between them, as the drain does,
-- and once assigned, the message's waiting entries removed: no return to WAITING can come
-- between the assignment and the removal, so the drain need not read the stage back. An
-- assignment made is counted here too (the capability's window, waiting_sets.py), where the
-- drain would send the count in a round trip of its own.
-- A claim refused (the record moved meanwhile: another dispatcher won it; or the fence
-- below) assigns nothing and removes nothing.
-- A cluster keeps the two scripts: the record and the instance's keys are in other slots.
--
-- KEYS[1]  record    P:m:{id}
-- KEYS[2]  card      P:a:{inst}
-- KEYS[3]  inflight  P:f:{inst}
-- KEYS[4]  queue     P:q:{inst}
-- KEYS[5]  rate      P:r:instance:{inst}
-- KEYS[6]  due       the message's deadline set (broker/due_clock.py)
-- KEYS[7]  waiting   P:w:{cap}, KEYS[8] unmatched P:u:{cap}: the message's waiting entries
-- KEYS[9]  assigned  the capability's assignment counter for the current window
-- KEYS[10] counters  P:counters (lua/count.lua), or absent: nothing counted
-- ARGV[1]  message id
-- ARGV[2]  heartbeat age (ms) after which the instance counts as down
-- ARGV[3]  the reaper's next look at the latest (ms): ZADD LT
-- ARGV[4]  a record field the claim is fenced on (lua/fence.lua), or "": no fence
-- ARGV[5]  the value it must hold ("": absent; workers/parked_envelopes.py)
-- ARGV[6]  how long (s) the assignment counter is kept
-- ARGV[7..] transition.lua's ARGV (no charge)
--
-- Returns transition.lua's answer; a claim made has assign.lua's answer appended (a refused
-- assignment leaves the record ROUTED, for the caller to send back to WAITING).
if ARGV[4] ~= '' then
  local refused = fenced_out(KEYS[1], ARGV[4], ARGV[5])
  if refused then
    return refused
  end
end
local moved = move_record({KEYS[1], KEYS[10]}, {unpack(ARGV, 7)})
if moved[1] ~= 1 then
  return moved
end
redis.call('ZADD', KEYS[6], 'LT', ARGV[3], ARGV[1])
moved[7] = assign_credit(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], moved[3], ARGV[13],
                         ARGV[2])
if moved[7] == 1 or moved[7] == 2 then  -- assigned now, or by an earlier try
  redis.call('ZREM', KEYS[7], ARGV[1])
  redis.call('ZREM', KEYS[8], ARGV[1])
end
if moved[7] == 1 then
  -- a statistic: a counter someone spoiled costs the count, never the assignment's answer
  pcall(function()
    redis.call('INCRBY', KEYS[9], 1)
    redis.call('EXPIRE', KEYS[9], ARGV[6])
  end)
end
return moved
