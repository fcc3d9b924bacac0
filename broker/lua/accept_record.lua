-- accept_record.lua: prepended to the scripts that create a message record (accept.lua,
-- accept_assign.lua; broker/scripts.py). `argv` is the caller's ARGV, laid out as
-- accept.lua's ARGV[1..12]; the record's further field, value pairs start at `fields_at`.
-- `counters` is the counters hash (lua/count.lua), or nil: nothing counted.
local function accept_record(rec, counters, argv, fields_at)
  local existing = redis.call('HMGET', rec, 'stage', 'attempt', 'invalid')
  if existing[1] then
    if not (existing[1] == 'REJECTED' and existing[3] == '1' and argv[8] ~= 'REJECTED') then
      return {0, existing[1], existing[2] or '0'}
    end
    redis.call('DEL', rec)
  end
  local attempt = argv[8] == 'ROUTED' and '1' or '0'
  local error = argv[8] == 'REJECTED' and argv[10] or ''
  local fields = {'envelope', argv[1], 'capability', argv[2], 'accepted_ms', argv[3],
                  'deadline_ms', argv[4], 'priority', argv[6], 'stage', argv[8],
                  'attempt', attempt, 'instance', argv[9], 'updated_ms', argv[3], 'error', error}
  -- a reply_to the envelope holds is not copied (broker/store.py passes "")
  if argv[5] ~= '' then
    fields[#fields + 1] = 'reply_to'
    fields[#fields + 1] = argv[5]
  end
  for i = fields_at, #argv do
    fields[#fields + 1] = argv[i]
  end
  redis.call('HSET', rec, unpack(fields))
  timeline_append(rec, argv[7], {{argv[3], 'ACCEPTED', '', '0', ''},
                                 {argv[3], argv[8], argv[9], attempt, argv[10]}})
  if argv[8] == 'REJECTED' then
    count_in(counters, argv[12], 'finished\t' .. argv[2] .. '\tREJECTED')
  else
    count_in(counters, argv[12], 'accepted\t' .. argv[2])
  end
  if argv[11] ~= '' then
    redis.call('EXPIRE', rec, argv[11])
  end
  return {1, argv[8], attempt}
end
