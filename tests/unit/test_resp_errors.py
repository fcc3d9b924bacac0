"""Redis error replies: transient ones read as 'unavailable', others stay errors."""

from __future__ import annotations

import pytest
from redis.exceptions import NoScriptError, ResponseError

from broker.errors import RedisUnavailable
from broker.resp import _error


@pytest.mark.parametrize(
    "message",
    [
        "LOADING Redis is loading the dataset in memory",
        "OOM command not allowed when used memory > 'maxmemory'.",
        "BUSY Redis is busy running a script.",
        "READONLY You can't write against a read only replica.",
    ],
)
def test_transient_error_replies_are_unavailability(message: str) -> None:
    assert isinstance(_error(message), RedisUnavailable)


def test_other_error_replies_stay_errors() -> None:
    assert type(_error("BUSYGROUP Consumer Group name already exists")) is ResponseError
    assert type(_error("WRONGTYPE Operation against a key")) is ResponseError
    assert isinstance(_error("NOSCRIPT No matching script"), NoScriptError)
