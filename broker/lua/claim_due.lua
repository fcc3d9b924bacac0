-- claim_due.lua: take the messages whose next deadline has come, for one reaper at a time.
--
-- KEYS[1]  due  P:due  (zset: message id -> next deadline, ms)
-- ARGV[1]  now (ms)
-- ARGV[2]  lease (ms): the claimed entries move to now + lease, out of every other reaper's
--          sight; the claimer sets their next deadline (or removes them) when done, and a
--          reaper that dies holding them only delays them by the lease
-- ARGV[3]  how many at most
--
-- Returns the claimed message ids, earliest deadline first.
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local until_ms = tonumber(ARGV[1]) + tonumber(ARGV[2])
for _, id in ipairs(ids) do
  redis.call('ZADD', KEYS[1], until_ms, id)
end
return ids
