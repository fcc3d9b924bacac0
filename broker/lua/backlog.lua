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
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local info = {}
  for i = 1, #group, 2 do
    info[group[i]] = group[i + 1]
  end
  if info['name'] == ARGV[1] then
    local undelivered = redis.call('XRANGE', KEYS[1], '(' .. info['last-delivered-id'], '+')
    return info['pending'] + #undelivered
  end
end
return 0
