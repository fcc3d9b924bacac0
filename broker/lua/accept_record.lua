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
  -- a new record (or one just deleted): no timeline to read
  local timeline = timeline_lines(nil, argv[7], {{argv[3], 'ACCEPTED', '', '0', ''},
                                                 {argv[3], argv[8], argv[9], attempt, argv[10]}})
  local fields = {'envelope', argv[1], 'capability', argv[2], 'accepted_ms', argv[3],
                  'deadline_ms', argv[4], 'stage', argv[8], 'timeline', timeline}
  -- a field that would hold its default is not written (broker/record_codec.py reads it
  -- back): attempt 0, no instance yet, priority 0, no error, updated when accepted; a
  -- reply_to the envelope holds is not copied (broker/store.py passes "")
  local optional = {'attempt', attempt ~= '0' and attempt or '', 'instance', argv[9],
                    'priority', argv[6] ~= '0' and argv[6] or '',
                    'error', argv[8] == 'REJECTED' and argv[10] or '', 'reply_to', argv[5]}
  for i = 1, #optional, 2 do
    if optional[i + 1] ~= '' then
      fields[#fields + 1] = optional[i]
      fields[#fields + 1] = optional[i + 1]
    end
  end
  for i = fields_at, #argv do
    fields[#fields + 1] = argv[i]
  end
  redis.call('HSET', rec, unpack(fields))
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
