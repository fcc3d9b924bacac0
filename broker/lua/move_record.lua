-- move_record.lua: prepended to the scripts that move a record (transition.lua,
-- claim_assign.lua; broker/scripts.py). `KEYS` and `ARGV` are transition.lua's, passed in:
-- the caller's own, or the part of them a fused script gives it.
local function count_level(counters, stage, ARGV)
  -- a level, not a count: e.g. the messages now waiting for an operator
  if (stage == ARGV[12]) ~= (ARGV[4] == ARGV[12]) then
    redis.call('HINCRBY', counters, 'level\t' .. ARGV[12], ARGV[4] == ARGV[12] and 1 or -1)
  end
end

local function usage_labels(day, ARGV, n)
  -- past the day's cap of combinations a new one is charged under "~other"; and whether
  -- the combination is new to the day (the hash may be new: its expiry is set then)
  local combo, tenant = ARGV[15 + n], ARGV[18 + n]
  local new = redis.call('HEXISTS', day, combo .. '\trequests') == 0
  if new and redis.call('HLEN', day) >= tonumber(ARGV[16 + n]) then
    combo = '~other\t~other\t~other'
    if ARGV[20 + n] ~= '1' then
      tenant = '~other'
    end
  end
  return combo, tenant, new
end

local function charge_move(KEYS, ARGV, n)
  -- Each write on its own, the spend (what budgets are enforced on) first: a usage key
  -- someone spoiled loses what goes to it, not the rest, and says so in Redis's log.
  local day, month = KEYS[#KEYS - 1], KEYS[#KEYS]
  local lost = {}
  local function write(...)
    local done, err = pcall(redis.call, ...)
    if not done then
      lost[#lost + 1] = type(err) == 'table' and err.err or tostring(err)
    end
  end
  local labelled, combo, tenant, new = pcall(usage_labels, day, ARGV, n)
  if not labelled then  -- the day's hash does not read: as past its cap (a budget's tenant
    combo = '~other\t~other\t~other'  -- keeps its name, so its month is still enforced)
    tenant = ARGV[20 + n] == '1' and ARGV[18 + n] or '~other'
    new = true
  end
  if tonumber(ARGV[19 + n]) > 0 then
    write('HINCRBYFLOAT', day, 'spend\t' .. tenant, ARGV[19 + n])
    write('HINCRBYFLOAT', month, 'spend\t' .. tenant, ARGV[19 + n])
    write('EXPIRE', month, ARGV[17 + n])
  end
  for i = 22 + n, 20 + n + 2 * tonumber(ARGV[21 + n]), 2 do
    -- a whole count (digits alone: broker/store.py, amount_arg) is added as an integer,
    -- the cheaper command; a field that holds a fraction, or would overflow, refuses it and
    -- takes it as a float
    local field, amount = combo .. '\t' .. ARGV[i], ARGV[i + 1]
    if not (string.find(amount, '^%d+$') and pcall(redis.call, 'HINCRBY', day, field, amount)) then
      write('HINCRBYFLOAT', day, field, amount)
    end
  end
  -- Kept from the day's first charge (its first combination), not renewed at every one:
  -- a combination already there means the hash has been given its expiry.
  if new then
    write('EXPIRE', day, ARGV[17 + n])
  end
  if #lost > 0 then
    redis.log(redis.LOG_WARNING, 'agent-reach: usage of ' .. KEYS[1] .. ' not all charged: '
              .. table.concat(lost, '; '))
  end
end

local function move_record(KEYS, ARGV)
  local rec = KEYS[1]
  local n = tonumber(ARGV[14])
  local charged = ARGV[15 + n] ~= ''
  local counters = KEYS[2]
  if charged and #KEYS == 3 then
    counters = nil  -- KEYS[2] and KEYS[3] are the usage hashes
  end
  local fields_at = 16 + n
  if charged then
    fields_at = 22 + n + 2 * tonumber(ARGV[21 + n])
  end
  local cur = redis.call('HMGET', rec, 'stage', 'attempt', 'instance', ARGV[11], 'capability',
                         'accepted_ms', 'timeline')
  if not cur[1] then
    return {-1}
  end
  local stage, attempt, instance = cur[1], cur[2] or '0', cur[3] or ''
  if not string.find(',' .. ARGV[1] .. ',', ',' .. stage .. ',', 1, true)
     or (ARGV[2] ~= '' and ARGV[2] ~= attempt)
     or (ARGV[3] ~= '' and ARGV[3] ~= instance) then
    return {0, stage, attempt, instance}
  end
  local new_attempt = attempt
  if ARGV[5] == '+' then
    new_attempt = tostring(tonumber(attempt) + 1)
  elseif ARGV[5] ~= '' then
    new_attempt = ARGV[5]
  end
  local new_instance = ARGV[6] ~= '' and ARGV[6] or instance
  local timeline = timeline_lines(cur[7], ARGV[9],
                                  {{ARGV[7], ARGV[4], new_instance, new_attempt, ARGV[8]}})
  redis.call('HSET', rec, 'stage', ARGV[4], 'attempt', new_attempt, 'instance', new_instance,
             'updated_ms', ARGV[7], 'timeline', timeline, unpack(ARGV, fields_at))
  -- The move is made. Counting and charging it follow, neither able to fail it (as
  -- count.lua's counts): a counters or usage key someone spoiled costs that count or that
  -- charge, never the answer that the move was made, nor the record's expiry below.
  if counters then
    pcall(count_level, counters, stage, ARGV)
  end
  for i = 15, 14 + n do
    count_in(counters, ARGV[13], ARGV[i])
  end
  if charged then
    charge_move(KEYS, ARGV, n)
  end
  if ARGV[10] == '' then
    -- out of a terminal stage again (an operator's replay): keep it until it ends anew
    redis.call('PERSIST', rec)
  elseif ARGV[10] ~= '-' then  -- '-': from no terminal stage, so no expiry to remove
    count_in(counters, ARGV[13], 'finished\t' .. (cur[5] or '') .. '\t' .. ARGV[4])
    redis.call('EXPIRE', rec, ARGV[10])
  end
  return {1, ARGV[4], new_attempt, new_instance, ARGV[11] ~= '' and cur[4] or false, cur[6] or '0'}
end

local function plain_move(argv, answers_field)
  -- no charge, no expiry to set or remove, and a field to answer only where allowed
  return argv[10] == '-' and argv[15 + tonumber(argv[14])] == ''
         and (answers_field or argv[11] == '')
end

-- Two moves of one record in a row (RECEIVED, then PROCESSING: receive_process.lua and
-- take.lua), answered as move_record twice would answer them, the second judged on what the
-- first left: in one read and one write of the record, not two of each. The first may
-- answer a field; where either charges or touches the expiry, move_record runs twice.
-- Returns the two answers; where the first is not made, its answer twice.
local function move_record_twice(KEYS, first, second)
  if not (plain_move(first, true) and plain_move(second, false)) then
    local moved = move_record(KEYS, first)
    if moved[1] ~= 1 then
      return moved, moved
    end
    return moved, move_record(KEYS, second)
  end
  local rec, counters = KEYS[1], KEYS[2]
  local cur = redis.call('HMGET', rec, 'stage', 'attempt', 'instance', first[11], 'capability',
                         'accepted_ms', 'timeline')
  if not cur[1] then
    return {-1}, {-1}
  end
  local stage, attempt, instance = cur[1], cur[2] or '0', cur[3] or ''
  local answers, from, entries, fields = {}, {}, {}, {}
  for i, argv in ipairs({first, second}) do
    if not string.find(',' .. argv[1] .. ',', ',' .. stage .. ',', 1, true)
       or (argv[2] ~= '' and argv[2] ~= attempt)
       or (argv[3] ~= '' and argv[3] ~= instance) then
      answers[i] = {0, stage, attempt, instance}
      break
    end
    if argv[5] == '+' then
      attempt = tostring(tonumber(attempt) + 1)
    elseif argv[5] ~= '' then
      attempt = argv[5]
    end
    instance = argv[6] ~= '' and argv[6] or instance
    entries[i] = {argv[7], argv[4], instance, attempt, argv[8]}
    for j = 16 + tonumber(argv[14]), #argv do
      fields[#fields + 1] = argv[j]
    end
    from[i], stage = stage, argv[4]
    answers[i] = {1, stage, attempt, instance, argv[11] ~= '' and cur[4] or false, cur[6] or '0'}
  end
  if answers[1][1] ~= 1 then
    return answers[1], answers[1]
  end
  local last = from[2] and second or first
  redis.call('HSET', rec, 'stage', stage, 'attempt', attempt, 'instance', instance,
             'updated_ms', last[7], 'timeline', timeline_lines(cur[7], last[9], entries),
             unpack(fields))
  for i, argv in ipairs({first, second}) do
    if from[i] then  -- counted as move_record counts, after the write
      if counters then
        pcall(count_level, counters, from[i], argv)
      end
      for j = 15, 14 + tonumber(argv[14]) do
        count_in(counters, argv[13], argv[j])
      end
    end
  end
  return answers[1], answers[2]
end
