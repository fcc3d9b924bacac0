-- assign_credit.lua: prepended to the scripts that assign (assign.lua, accept_assign.lua,
-- claim_assign.lua, accept_direct.lua; broker/scripts.py): the one home of the credit rule.
-- Appends attempt `attempt` of message `id` to the instance's stream `queue` only against a
-- free credit; the codes are assign.lua's. credit_verdict judges without writing (and the
-- rate's next arrival time, where the instance has a rate), take_credit writes.
local function credit_verdict(card_key, inflight, rate, id, attempt, now_ms, down_after)
  local card = redis.call('HMGET', card_key, 'state', 'credits', 'hb_ms', 'rate_ms', 'burst')
  if not card[1] then
    return -1
  end
  if card[1] ~= 'UP' and card[1] ~= 'DEGRADED' then
    return -2
  end
  if tonumber(now_ms) - tonumber(card[3] or '0') > tonumber(down_after) then
    return -3
  end
  local member = id .. ':' .. attempt
  if redis.call('SCARD', inflight) >= tonumber(card[2] or '0') then
    -- At the limit: a repeat of an assignment already made is still an answer of its own.
    return redis.call('SISMEMBER', inflight, member) == 1 and 2 or 0
  end
  if redis.call('SISMEMBER', inflight, member) == 1 then
    return 2  -- a repeat of an assignment already made
  end
  local interval = tonumber(card[4] or '0') or 0
  local new_tat
  if interval > 0 and rate then
    local now = tonumber(now_ms)
    local burst = tonumber(card[5] or '1') or 1
    local tat = tonumber(redis.call('GET', rate) or '0') or 0
    if tat > now + (burst + 1) * interval then
      tat = now  -- written by a clock ahead of this caller's (broker/gcra.py)
    end
    new_tat = math.max(tat, now) + interval
    if new_tat - now - burst * interval > 0.001 then
      return -4
    end
  end
  return 1, new_tat
end

local function take_credit(inflight, queue, rate, id, attempt, now_ms, new_tat)
  -- The stream first: a key of another type (whoever may park work may make one) refuses
  -- the XADD before anything is written. A script is not rolled back: a credit taken first
  -- stayed held, for no entry, until the janitor's hourly audit.
  redis.call('XADD', queue, '*', 'id', id, 'attempt', attempt)
  redis.call('SADD', inflight, id .. ':' .. attempt)
  if new_tat then
    local now = tonumber(now_ms)
    redis.call('SET', rate, string.format('%.3f', new_tat), 'PX', math.ceil(new_tat - now) + 1000)
  end
end

local function assign_credit(card_key, inflight, queue, rate, id, attempt, now_ms, down_after)
  local verdict, new_tat = credit_verdict(card_key, inflight, rate, id, attempt, now_ms,
                                          down_after)
  if verdict ~= 1 then
    return verdict
  end
  take_credit(inflight, queue, rate, id, attempt, now_ms, new_tat)
  return 1
end
