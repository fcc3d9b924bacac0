-- transition_if.lua: transition.lua's compare-and-set, made only where the record's field
-- ARGV[1] holds ARGV[2] ("" where the field is absent). A sidecar's move from PROCESSING to
-- PROCESSING is fenced so on the token of the round trip that last wrote PROCESSING
-- (`take_call`, adapters/holdings.py), as read when it decided: such a move, delivered late
-- (a write given up on that a network still held), cannot write over a later one.
--
-- KEYS      transition.lua's
-- ARGV[1]   the field, ARGV[2] the value it must hold
-- ARGV[3..] transition.lua's ARGV
--
-- Returns transition.lua's answer; {0, stage, attempt, instance} also where the field holds
-- another value.
local refused = fenced_out(KEYS[1], ARGV[1], ARGV[2])
if refused then
  return refused
end
return move_record(KEYS, {unpack(ARGV, 3)})
