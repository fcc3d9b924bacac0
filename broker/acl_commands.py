"""The Redis commands each role's processes run, as data: the ACL rules of :mod:`broker.acl`
grant these, one by one, and ``tests/unit/test_acl.py`` reads every command out of the code
(Python and Lua) to check that a role is granted each one it sends.

Redis checks the commands a script runs against its caller's rules too, so a role that calls a
script is granted what the script runs.
"""

from __future__ import annotations

# Every process PINGs at start-up; SELECT serves a URL naming a database other than 0;
# CLUSTER SLOTS tells a cluster node (and its slot map), ASKING follows a slot in migration,
# INFO (on a cluster) the server's version: whether it has sharded pub/sub; WAIT holds a
# round trip's writes until replicas have them (replica_acks); TIME aligns the process's
# clock to Redis's (broker.timekeeping).
CONNECT = ("ping", "select", "cluster|slots", "asking", "info", "wait", "time")
# commands Redis 6.2 does not have: left out of its rules (nothing sends them to it)
SINCE_7 = frozenset({"spublish", "ssubscribe"})
# Scripts are called by sha; whoever meets NOSCRIPT (a restarted Redis) loads them again.
SCRIPTS = ("evalsha", "script|load")

PRODUCER_SUBMIT = ("xadd",)
PRODUCER_REPLIES = ("xread", "xdel", "del")
# records, timelines and broadcast outcomes: transition.lua, child_done.lua and their readers
RECORD_COMMANDS = (
    "evalsha",
    "hget",
    "hgetall",
    "hmget",
    "hset",
    "hsetnx",
    "hdel",
    "hlen",
    "rpush",
    "ltrim",
    "lrange",
    "expire",
    "persist",
    # the counters, in the same scripts (lua/count.lua: HINCRBY; HLEN and HDEL past the cap)
    "hincrby",
    # an attempt's usage, charged in the script that records it (lua/transition.lua)
    "hincrbyfloat",
    "hexists",
)
# a sidecar's own card, work stream, in-flight set and callback key (heartbeat.lua,
# release.lua, registering, draining, trimming its stream)
INSTANCE_COMMANDS = (
    "evalsha",
    "exists",  # card_set.lua: a state written only on a card that exists
    "hset",
    "hget",
    "hmget",  # heartbeat.lua: the state and circuit before (events report a change)
    "hgetall",
    "del",
    "xgroup|create",
    "xreadgroup",
    # take.lua and the blocking read before it: the stream's last id, the script's clock
    "xread",
    "xrevrange",
    "time",
    "xack",
    "xinfo|groups",
    "xpending",
    "xtrim",
    "xrange",
    "srem",
    "scard",
    "set",
    "get",
    "publish",
    "spublish",
)
TELL_COMMANDS = ("xadd", "expire")  # a reply (with its TTL), a webhook, a dead letter
PARK_COMMANDS = ("zadd", "sadd")  # the due index, a waiting set and the waiting index
REGISTER_COMMANDS = ("zadd", "zrem")  # the registry index
BROKER_COMMANDS = (
    *CONNECT,
    *SCRIPTS,
    "xadd",
    "xack",
    "xautoclaim",
    "xclaim",
    "xdel",
    "xgroup|create",
    "xinfo|groups",
    "xlen",
    "xpending",
    "xrange",
    "xrevrange",  # take.lua (every script is the broker's to run)
    "time",
    "xreadgroup",
    "xtrim",
    "hdel",
    "hexists",
    "hget",
    "hgetall",
    "hincrby",
    "hincrbyfloat",
    "hlen",
    "hmget",
    "hset",
    "hsetnx",
    "del",
    "exists",
    "expire",
    "persist",
    # the janitor: an older version's timeline list leaves with its record
    "ttl",
    "pttl",
    "pexpire",
    "lrange",
    "ltrim",
    "rpush",
    "sadd",
    "scard",
    "sismember",
    "smembers",
    "sscan",  # the credit audit reads an in-flight set a chunk at a time
    "srem",
    "zadd",
    "zcard",
    "zrange",
    "zrangebyscore",
    "zrem",
    "zscore",
    "get",
    "incrby",
    "mget",
    "set",
    "publish",
    "subscribe",
    "ssubscribe",
    "spublish",
    "multi",
    "exec",
    # the janitor pages through the prefix's keys (SCAN MATCH P:*): SCAN takes no key, so
    # the rule cannot bind it to the prefix; it lists other names, it reads no values
    "scan",
)
OPERATOR_READS = (
    "exists",
    "hget",
    "hgetall",
    "hmget",
    "lindex",
    "lrange",
    "mget",
    "scard",
    "smembers",
    "xinfo|groups",
    "xlen",
    "xrange",
    "xrevrange",
    "xread",  # agent-reach events --follow
    "zcard",
    "zrange",
    "zrangebyscore",
    "zscore",
)
# replay, resolve and cancel move records (transition.lua) and tell producers (replies,
# webhooks, a broadcast parent: child_done.lua); weight and drain change a card
OPERATOR_WRITES = (
    "evalsha",
    "hexists",
    "hincrby",
    "hset",
    "hsetnx",
    "hdel",
    "hlen",
    "rpush",
    "ltrim",
    "expire",
    "persist",
    "zadd",
    "zrem",
    "sadd",
    "xadd",
    "publish",
    # feedback: a rating on its agent's list (P:fb:*, capped)
    "lpush",
)
