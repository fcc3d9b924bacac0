-- finish.lua: a sidecar's finishing round in the round trip that records its outcomes (one
-- server only: adapters/finisher.py sends it in the same pipeline, after the moves). Each
-- entry's producer is told if its outcome is on the record, then its credit is freed and its
-- entry acknowledged: what took three round trips (record, tell, release) takes one.
--
-- KEYS[1]  inflight  P:f:{inst}
-- KEYS[2]  queue     P:q:{inst}
-- ARGV[1..4] as release.lua's: the queue's group, the credit channel, the instance id, "1"
--          to announce with SPUBLISH
-- ARGV[5..] for each entry: member ("id:attempt"), entry id, its record's key ("": no outcome
--          to check), the stages its move starts from (comma-separated), its attempt, the
--          stage it moves to, n: how many commands tell its producer; then for each command:
--          argc, the command's name, its key, argc arguments
--
-- The records and the replies' keys are named in ARGV, not KEYS: a sidecar's Redis user
-- (broker/acl.py) may run scripts on its own instance's keys, and each command here is
-- checked against its own key as it runs — a record, a reply stream, an outbox — as if the
-- sidecar had sent it. One server only: on a cluster they would be on other nodes.
--
-- An entry with no outcome, or whose record shows its move made (its stage, its attempt,
-- this instance), is told: each command run (redis.pcall); when Redis accepted them all its
-- credit is freed. An entry whose record moved on without it (fenced: another attempt, or
-- gone) is released untold. An entry whose record is still where its move starts (the move
-- did not run) is held, and so is one with a command Redis refused: the finisher records the
-- first again, and dead-letters the second (or, for a refusal that means "not now" — OOM,
-- READONLY — tries again later) before it releases it itself (release.lua). A refusal also
-- stops the script: the entries after it are held untouched, for the finisher's next round.
-- (Past its first write a script is no longer refused for memory: telling on past an OOM
-- would write replies beyond maxmemory, and again at every retry.)
--
-- Returns {freed, held...}: each held entry {index (from 1), 0} for a move not made,
-- {index, 1, command number, error} for a command Redis refused, {index, 2} for one not
-- reached.
local instance = ARGV[3]
local freed = 0
local out = {0}
local i = 5
local index = 0
local stopped = false
while i <= #ARGV do
  index = index + 1
  local member, entry_id, record = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local sources, attempt, target = ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
  local commands = tonumber(ARGV[i + 6])
  i = i + 7
  local state = 'told'
  if stopped then
    state = 'unreached'
  elseif record ~= '' then
    local cur = redis.pcall('HMGET', record, 'stage', 'attempt', 'instance')
    if cur.err then
      state = 'held'
    elseif cur[1] == target and cur[2] == attempt and cur[3] == instance then
      state = 'told'
    elseif cur[1] and cur[2] == attempt and cur[3] == instance
           and string.find(',' .. sources .. ',', ',' .. cur[1] .. ',', 1, true) then
      state = 'held'
    else
      state = 'fenced'
    end
  end
  for c = 1, commands do
    local argc = tonumber(ARGV[i])
    if state == 'told' then
      local reply = redis.pcall(ARGV[i + 1], ARGV[i + 2], unpack(ARGV, i + 3, i + 2 + argc))
      if type(reply) == 'table' and reply.err then
        state = 'refused'
        out[#out + 1] = {index, 1, c, reply.err}
      end
    end
    i = i + 3 + argc
  end
  if state == 'held' then
    out[#out + 1] = {index, 0}
  elseif state == 'unreached' then
    out[#out + 1] = {index, 2}
  elseif state == 'refused' then
    stopped = true
  else
    freed = freed + free_credit(KEYS[1], KEYS[2], ARGV[1], member, entry_id)
  end
end
if freed > 0 then
  announce_credits(KEYS[1], ARGV[2], instance, ARGV[4])
end
out[1] = freed
return out
