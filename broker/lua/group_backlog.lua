-- group_backlog.lua: prepended to the scripts that judge what a consumer group has not
-- finished (backlog.lua, accept_direct.lua; broker/scripts.py): one reading of a group, in
-- one atomic step (two separate reads can count an entry twice).
--
-- The pending count of `stream`'s group `group` and how many entries lie past its last
-- delivered id (at most `most`, when given: enough to tell whether there are any); nil when
-- the stream has no such group. The stream must exist (XINFO refuses a missing key).
local function group_backlog(stream, group, most)
  for _, fields in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {}
    for i = 1, #fields, 2 do
      info[fields[i]] = fields[i + 1]
    end
    if info['name'] == group then
      local after = '(' .. info['last-delivered-id']
      local undelivered
      if most then
        undelivered = redis.call('XRANGE', stream, after, '+', 'COUNT', most)
      else
        undelivered = redis.call('XRANGE', stream, after, '+')
      end
      return info['pending'], #undelivered
    end
  end
  return nil
end
