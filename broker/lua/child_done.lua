-- child_done.lua: record one broadcast child's outcome on its parent; the last one ends the
-- parent.
--
-- KEYS[1]  record    P:m:{parent}  (hash; `children`, `timeline_max`, `ttl_s` written at fan-out)
-- KEYS[2]  outcomes  P:b:{parent}  (hash: child id -> outcome JSON)
-- KEYS[3]  counters  P:counters (hash, lua/count.lua), or absent: nothing counted
-- ARGV[1]  child id
-- ARGV[2]  outcome JSON, starting {"stage":"<STAGE>", ... (broker/results.py ChildOutcome)
-- ARGV[3]  now (ms)
-- ARGV[4]  the stage a parent waits for its children in (from broker/stages.py)
-- ARGV[5]  the stage it ends in once every child has an outcome
-- ARGV[6]  the counters' cap (distinct fields); the parent's end counts
--          "finished\t<capability>\t<stage>"
--
-- A child's first outcome wins: a re-sent one changes nothing. The parent ends with `result`
-- = JSON {instance id: outcome, ...} in child order, a timeline entry, the terminal expiry on
-- record and outcomes, and `reply_pending` (cleared once its producer is told).
--
-- Returns {1, result, envelope}  the parent just ended: tell its producer;
--         {2, result, envelope}  a repeat, and the parent has ended untold: tell it (again);
--         {0}                    recorded or a repeat; nothing to tell;
--         {-1}                   no parent record;  {-2} not a child of this parent.
local rec = KEYS[1]
local cur = redis.call('HMGET', rec, 'stage', 'children', 'reply_pending', 'timeline_max',
                       'ttl_s', 'attempt', 'capability')
if not cur[1] then
  return {-1}
end
if not cur[2] then
  return {-2}
end
local children = cjson.decode(cur[2])
local known = false
for _, pair in ipairs(children) do
  if pair[1] == ARGV[1] then
    known = true
    break
  end
end
if not known then
  return {-2}
end
if redis.call('HSETNX', KEYS[2], ARGV[1], ARGV[2]) == 0 then
  if cur[1] == ARGV[5] and cur[3] then
    local told = redis.call('HMGET', rec, 'result', 'envelope')
    return {2, told[1], told[2]}
  end
  return {0}
end
if cur[1] ~= ARGV[4] or redis.call('HLEN', KEYS[2]) < #children then
  return {0}
end
local flat = redis.call('HGETALL', KEYS[2])
local outcomes = {}
for i = 1, #flat, 2 do
  outcomes[flat[i]] = flat[i + 1]
end
local parts, counts = {}, {}
for _, pair in ipairs(children) do
  local outcome = outcomes[pair[1]]
  parts[#parts + 1] = cjson.encode(pair[2]) .. ':' .. outcome
  local stage = string.match(outcome, '^{"stage":"([%u_]+)"') or '?'
  counts[stage] = (counts[stage] or 0) + 1
end
local result = '{' .. table.concat(parts, ',') .. '}'
local names = {}
for stage in pairs(counts) do
  names[#names + 1] = stage
end
table.sort(names)
local summary = {}
for _, stage in ipairs(names) do
  summary[#summary + 1] = counts[stage] .. ' ' .. stage
end
local reason = 'all ' .. #children .. ' children ended: ' .. table.concat(summary, ', ')
redis.call('HSET', rec, 'stage', ARGV[5], 'updated_ms', ARGV[3], 'result', result,
           'reply_pending', '1')
timeline_append(rec, cur[4] or '200', {{ARGV[3], ARGV[5], '', cur[6] or '0', reason}})
count_in(KEYS[3], ARGV[6], 'finished\t' .. (cur[7] or '') .. '\t' .. ARGV[5])
if cur[5] then
  redis.call('EXPIRE', rec, cur[5])
  redis.call('EXPIRE', KEYS[2], cur[5])
end
return {1, result, redis.call('HGET', rec, 'envelope')}
