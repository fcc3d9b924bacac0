-- reschedule_due.lua: a reaper's verdicts on the messages it leased, written only where the
-- lease still stands. Someone else may have set a message's next look meanwhile (a dispatcher
-- routing it: sooner; an operator replaying it: a fresh one); theirs wins.
--
-- KEYS[1]  due  P:due
-- ARGV[1]  the lease's score (as claim_due.lua set it)
-- ARGV[2..] message id, next look (ms) or "" to remove it — pairs
--
-- Returns how many were written.
local written = 0
local lease = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) == lease then
    if ARGV[i + 1] == '' then
      redis.call('ZREM', KEYS[1], ARGV[i])
    else
      redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
    end
    written = written + 1
  end
end
return written
