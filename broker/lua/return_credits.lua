-- return_credits.lua: return credits that no sidecar will return (the reaper's take-over and
-- endings, the janitor's audit), and announce it as release.lua does: a dispatcher waiting
-- for the instance's credits hears of them at once, not at its next sweep.
--
-- KEYS[1]  inflight  P:f:{inst}  (set of "id:attempt")
-- ARGV[1]  channel to announce freed credits on
-- ARGV[2]  instance id; the announcement is "<instance id> <credits now in use>"
-- ARGV[3]  "1": announce with SPUBLISH (a sharded channel, in the slot of KEYS: a Redis 7
--          cluster), else PUBLISH
-- ARGV[4..] the members to return
--
-- Returns the number of credits returned; nothing returned, nothing announced.
local returned = 0
for i = 4, #ARGV do
  returned = returned + redis.call('SREM', KEYS[1], ARGV[i])
end
if returned > 0 then
  announce_credits(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
end
return returned
