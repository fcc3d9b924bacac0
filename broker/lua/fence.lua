-- fence.lua: prepended to the scripts that make a move only where a record's field holds a
-- value (transition_if.lua, claim_assign.lua; broker/scripts.py).
--
-- fenced_out is nil where the record's field `field` holds `value` ("" where the field is
-- absent); else the answer of a move refused: {0, stage, attempt, instance}, or {-1} where
-- there is no record.
local function fenced_out(rec, field, value)
  if (redis.call('HGET', rec, field) or '') == value then
    return nil
  end
  local cur = redis.call('HMGET', rec, 'stage', 'attempt', 'instance')
  if not cur[1] then
    return {-1}
  end
  return {0, cur[1], cur[2] or '0', cur[3] or ''}
end
