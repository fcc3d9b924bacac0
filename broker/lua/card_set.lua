-- card_set.lua: fields written on an instance's card only while the card exists. An
-- operator's weight or drain racing a deregistration (or a sidecar's drain after a Redis that
-- lost its data) must not leave a card of one field behind: no TTL, no instance, never read.
--
-- KEYS[1]  card  P:a:{inst}  (hash)
-- ARGV     field, value, ... (at least one pair)
--
-- Returns 1 when written, 0 when there is no card.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
