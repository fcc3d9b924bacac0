-- backlog.lua: entries on an instance's stream not yet finished — pending in the group plus
-- never delivered — read in one atomic step (two separate reads can count an entry twice).
--
-- KEYS[1]  queue  P:q:{inst}
-- ARGV[1]  consumer group of the queue
--
-- Returns the count (0 when the stream or group does not exist).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local pending, undelivered = group_backlog(KEYS[1], ARGV[1])
if not pending then
  return 0
end
return pending + undelivered
