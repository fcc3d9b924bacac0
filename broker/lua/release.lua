-- release.lua: return the credits of finished entries, acknowledge them, and announce it.
--
-- KEYS[1]  inflight  P:f:{inst}  (set of "id:attempt")
-- KEYS[2]  queue     P:q:{inst}  (stream; group ARGV[1])
-- ARGV[1]  consumer group of the queue
-- ARGV[2]  channel to announce freed credits on
-- ARGV[3]  instance id; the announcement is "<instance id> <credits now in use>"
-- ARGV[4]  "1": announce with SPUBLISH (a sharded channel, in the slot of KEYS: a Redis 7
--          cluster), else PUBLISH
-- ARGV[5..] member, entry id pairs
--
-- Returns the number of credits freed.
local freed = 0
for i = 5, #ARGV, 2 do
  freed = freed + free_credit(KEYS[1], KEYS[2], ARGV[1], ARGV[i], ARGV[i + 1])
end
if freed > 0 then
  announce_credits(KEYS[1], ARGV[2], ARGV[3], ARGV[4])
end
return freed
