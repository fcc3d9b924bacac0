-- take.lua: a sidecar's new entries read and taken in one script (adapters/intake.py): its
-- group's XREADGROUP (no BLOCK: a script may not wait), then, for each entry that is plainly
-- an assignment, RECEIVED and PROCESSING exactly as lua/receive_process.lua makes them. The
-- sidecar sends it in one write behind a blocking XREAD of the same stream
-- (broker/streams.py, GroupReader.read_then_run): Redis runs a client's commands in order,
-- so the script runs as soon as an entry comes, and the sidecar wakes once, not twice.
-- Single server only: a record's key is made here from the entry, not passed in KEYS.
--
-- An entry is taken here only when it is exactly the fields `id` (1-128 of letters, digits
-- and _ . : -) and `attempt` (1 to the highest, no leading zero): never looser than
-- broker/entries.py's parse_assignment, which Python still applies to every entry. Any other
-- entry is left untouched to Python, which takes it or refuses it with why.
--
-- KEYS[1]  the instance's stream (its only key: a sidecar's ACL user may run a script on its
--          stream, or on the records and counters, never on both; broker/acl.py)
-- ARGV[1] the group, ARGV[2] the consumer, ARGV[3] how many entries at most
-- ARGV[4], ARGV[5]  a record's key before and after its message id (broker/keyspace.py)
-- ARGV[6]  the counters (lua/count.lua), or "": nothing counted
-- ARGV[7]  the highest attempt
-- ARGV[8]  the envelope bytes this script may answer: once the envelopes of the entries it
--          took reach it, it leaves the rest to Python (one receive_process.lua each, which
--          Redis runs between other clients' commands), so no batch of large envelopes holds
--          Redis, and the sidecar's read, for long
-- ARGV[9]  this call's token, written on every PROCESSING it makes (field `take_call`): a
--          sidecar whose call went unanswered (a partition while it waited) knows from it
--          that it never called the agent with such a record, and runs it
--          (adapters/runner.py, Runner._restarted) instead of judging it a crash's leftover
-- ARGV[10] a: how many of the arguments after ARGV[11] are the RECEIVED move's
-- ARGV[11] b: how many after those are the PROCESSING move's at a first attempt; the rest
--          are the PROCESSING move's at a later attempt. Each is transition.lua's ARGV (no
--          charge) with its expected attempt (2nd) and time (7th) set here: the entry's
--          attempt, and the server's clock (the script may wait behind the XREAD).
--
-- Returns {after, entry, ...}: `after` is the id the next XREAD waits past (the last entry
-- read; else the stream's last; else "0-0"); each entry is {id, fields} when left to Python
-- (not plainly an assignment, or past the envelope bytes),
-- {id, fields, error} when a move failed (written so far stays, as in receive_process.lua),
-- else {id, fields, received, processing}: transition.lua's answers, RECEIVED's for both when
-- RECEIVED was not made. {"", error} when the group could not be read.
if redis.replicate_commands then
  redis.replicate_commands()  -- Redis 6.2: effects replication, for TIME before the writes
end
local time = redis.call('TIME')  -- before any write: a user who may not fails here, unread
local now = string.format('%.0f', tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000))
local ok, read = pcall(redis.call, 'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3],
                       'STREAMS', KEYS[1], '>')
local function error_of(e)
  if type(e) == 'table' then
    e = e.err
  end
  return {err = tostring(e)}
end
if not ok then
  return {'', error_of(read)}
end
local a, b = tonumber(ARGV[10]), tonumber(ARGV[11])
local receiving = {unpack(ARGV, 12, 11 + a)}
local first = {unpack(ARGV, 12 + a, 11 + a + b)}
local later = {unpack(ARGV, 12 + a + b)}
for _, processing in ipairs({first, later}) do  -- field pairs come last (transition.lua)
  processing[#processing + 1] = 'take_call'
  processing[#processing + 1] = ARGV[9]
end
local highest = tonumber(ARGV[7])
local budget, spent = tonumber(ARGV[8]), 0

local function assignment(fields)
  if #fields ~= 4 then
    return nil
  end
  local id, attempt
  if fields[1] == 'id' and fields[3] == 'attempt' then
    id, attempt = fields[2], fields[4]
  elseif fields[1] == 'attempt' and fields[3] == 'id' then
    id, attempt = fields[4], fields[2]
  else
    return nil
  end
  if #id > 128 or not string.find(id, '^[0-9A-Za-z_.:%-]+$')
     or #attempt > 10 or not string.find(attempt, '^[1-9][0-9]*$')
     or tonumber(attempt) > highest then
    return nil
  end
  return id, attempt
end

local entries = read and read[1][2] or {}
local taken = {'0-0'}
if #entries > 0 then
  taken[1] = entries[#entries][1]
else
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  if #last > 0 then
    taken[1] = last[1][1]
  end
end
local keys = {''}
if ARGV[6] ~= '' then
  keys[2] = ARGV[6]
end
for i, entry in ipairs(entries) do
  local id, attempt = assignment(entry[2])
  if not id or spent >= budget then
    taken[i + 1] = {entry[1], entry[2]}
  else
    keys[1] = ARGV[4] .. id .. ARGV[5]
    local processing = attempt == '1' and first or later
    receiving[2], receiving[7], processing[2], processing[7] = attempt, now, attempt, now
    local made, moves = pcall(function()
      local received, processed = move_record_twice(keys, receiving, processing)
      return {received, processed}
    end)
    if made then
      taken[i + 1] = {entry[1], entry[2], moves[1], moves[2]}
      if type(moves[1][5]) == 'string' then  -- the envelope RECEIVED answers
        spent = spent + #moves[1][5]
      end
    else
      taken[i + 1] = {entry[1], entry[2], error_of(moves)}
    end
  end
end
return taken
