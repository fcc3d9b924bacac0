"""Redis error replies become our errors at the boundary: transient ones read as
'unavailable', the others as a :class:`RedisReplyError` that carries its code."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from broker.errors import ReachError, RedisReplyError, RedisUnavailable
from broker.resp import TRANSIENT, error_reply


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("LOADING Redis is loading the dataset in memory", "LOADING"),
        ("OOM command not allowed when used memory > 'maxmemory'.", "OOM"),
        ("BUSY Redis is busy running a script.", "BUSY"),
        ("READONLY You can't write against a read only replica.", "READONLY"),
        # Redis 6.2: a script refused for memory, as it wraps an error a script did not catch
        (
            "ERR Error running script (call to f_fa5d8f2912c2de785639ac18b8ccdc0b9a5ff424): "
            "@user_script:1: @user_script: 1: -OOM command not allowed when used memory > "
            "'maxmemory'.",
            "OOM",
        ),
        (
            "ERR Error running script (call to f_0a1b): @user_script:7: @user_script: 7: "
            "-READONLY You can't write against a read only replica.",
            "READONLY",
        ),
        # Redis 6.2, what pcall(redis.call, ...) caught, handed back by a script
        ("=[C]: -1: -OOM command not allowed when used memory > 'maxmemory'.", "OOM"),
        ("MISCONF Redis is configured to save RDB snapshots, but it's currently unable", "MISCONF"),
        ("NOREPLICAS Not enough good replicas to write.", "NOREPLICAS"),
    ],
)
def test_transient_error_replies_are_unavailability(message: str, code: str) -> None:
    error = error_reply(message)

    assert isinstance(error, RedisUnavailable) and error.code == code
    assert message in str(error)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("BUSYGROUP Consumer Group name already exists", "BUSYGROUP"),  # not BUSY
        ("WRONGTYPE Operation against a key holding the wrong kind of value", "WRONGTYPE"),
        ("NOSCRIPT No matching script. Please use EVAL.", "NOSCRIPT"),
        ("NOGROUP No such key 'P:outbox' or consumer group 'notify'", "NOGROUP"),
        ("NOPERM this user has no permissions to run the 'keys' command", "NOPERM"),
        ("ERR unknown command 'NOPE'", "ERR"),
        ("", ""),
        # Redis 6.2 wraps what a script did not catch; 7 answers with the code first
        (
            "ERR Error running script (call to f_0a1b): @user_script:3: WRONGTYPE Operation "
            "against a key holding the wrong kind of value",
            "WRONGTYPE",
        ),
        # a Lua error has no code of its own
        ("ERR Error running script (call to f_0a1b): @user_script:3: bad argument", "ERR"),
    ],
)
def test_other_error_replies_carry_their_code_and_the_whole_reply(message: str, code: str) -> None:
    error = error_reply(message)

    assert type(error) is RedisReplyError and isinstance(error, ReachError)
    assert (error.code, error.message, str(error)) == (code, message, message)


@given(st.text(max_size=60))
def test_any_reply_text_becomes_one_of_our_two_errors(message: str) -> None:
    assume(not message.startswith(("ERR Error running script", "@user_script", "=[C]")))
    error = error_reply(message)

    code = message.split(" ", 1)[0]
    assert error.code == code
    assert isinstance(error, RedisUnavailable) is (code in TRANSIENT)
    assert isinstance(error, RedisReplyError) is (code not in TRANSIENT)
