-- renew_own.lua: renew a consumer's claim on one pending entry only while it is still that
-- consumer's: the check a lease holder makes right before an effect it must not share (a
-- notifier's POST). XCLAIM alone would take the entry from whoever holds it now.
--
-- KEYS[1]  stream
-- ARGV[1]  group
-- ARGV[2]  consumer
-- ARGV[3]  entry id
--
-- Returns 1 when the entry was this consumer's (its idle time is now 0), 0 when it is not
-- (taken over, or no longer pending).
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #pending == 1 and pending[1][2] == ARGV[2] then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
  return 1
end
return 0
