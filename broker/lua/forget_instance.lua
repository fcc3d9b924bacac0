-- forget_instance.lua: forget an instance gone for good — its card, work stream, in-flight set
-- and callback key — once it has been silent long enough and holds nothing.
--
-- KEYS[1]  card          P:a:{inst}  (hash; may be gone already: deregistered)
-- KEYS[2]  inflight      P:f:{inst}  (set of "id:attempt" = credits in use)
-- KEYS[3]  queue         P:q:{inst}  (stream; group ARGV[3])
-- KEYS[4]  callback key  P:k:{inst}  (string)
-- ARGV[1]  now (ms)
-- ARGV[2]  how long it must have been silent (ms)
-- ARGV[3]  consumer group of the queue
--
-- Returns 1 when forgotten, 0 when kept: heard from lately, a credit held, or an entry its
-- sidecar read and never finished. (Entries never read hold no credit once every credit is
-- back: the records they named have moved on, and fencing would drop them.)
local hb = tonumber(redis.call('HGET', KEYS[1], 'hb_ms') or '0') or 0
if tonumber(ARGV[1]) - hb < tonumber(ARGV[2]) then
  return 0
end
if redis.call('SCARD', KEYS[2]) > 0 then
  return 0
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[3])) do
    local info = {}
    for i = 1, #group, 2 do
      info[group[i]] = group[i + 1]
    end
    if info['name'] == ARGV[3] and tonumber(info['pending']) > 0 then
      return 0
    end
  end
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4])
return 1
