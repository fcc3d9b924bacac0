-- receive_process.lua: a sidecar's first two moves of an assignment it has just read, in one
-- script (adapters/intake.py): RECEIVED (transition.lua, fenced on ROUTED at the entry's
-- attempt and instance) and then PROCESSING (fenced on RECEIVED the same way), made only
-- where RECEIVED was: nothing else runs between the two, and one call does both, in one
-- read and one write of the record (move_record_twice, lua/move_record.lua).
--
-- KEYS          transition.lua's (the record, then the counters or none), for both moves
-- ARGV[1]       n: how many of the arguments that follow are the RECEIVED move's
-- ARGV[2..n+1]  the RECEIVED move's transition.lua ARGV (no charge)
-- ARGV[n+2..]   the PROCESSING move's transition.lua ARGV (no charge)
--
-- Returns {received, processing}, each transition.lua's answer; when RECEIVED was not made,
-- RECEIVED's answer stands for both.
local n = tonumber(ARGV[1])
local received, processing = move_record_twice(KEYS, {unpack(ARGV, 2, n + 1)},
                                               {unpack(ARGV, n + 2)})
return {received, processing}
