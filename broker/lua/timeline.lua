-- timeline.lua: prepended to the scripts that write a message's timeline (broker/scripts.py).
--
-- The timeline is the record's field `timeline`: one JSON array [ts, stage, instance, attempt,
-- reason] per line (cjson escapes a newline inside a string, so every line is one entry), the
-- oldest first, at most `cap` lines. It lives in the record, not in a list of its own: a key
-- of its own cost ~260 bytes per message beyond its entries (python -m bench.memory). Records
-- written before it moved keep their entries in the list P:t:{id}, read before the field.
--
-- timeline_lines is the field's new value: a script that reads and writes the record anyway
-- (move_record.lua, accept_record.lua) reads `timeline` with its other fields and writes the
-- new value with them, two commands fewer per move than timeline_append's own read and write.
local function timeline_lines(known, cap, entries)
  local parts = {}
  if known and known ~= '' then
    parts[1] = known
  end
  for _, entry in ipairs(entries) do
    parts[#parts + 1] = cjson.encode(entry)
  end
  local lines = table.concat(parts, '\n')
  cap = tonumber(cap)
  -- an entry is longer than 20 bytes: a shorter timeline cannot be over its cap
  if #lines > cap * 20 then
    local n = 1
    for _ in string.gmatch(lines, '\n') do
      n = n + 1
    end
    local from = 1
    while n > cap do
      from = string.find(lines, '\n', from, true) + 1
      n = n - 1
    end
    lines = string.sub(lines, from)
  end
  return lines
end

local function timeline_append(rec, cap, entries)
  local known = redis.call('HGET', rec, 'timeline')
  redis.call('HSET', rec, 'timeline', timeline_lines(known, cap, entries))
end
