"""Which error replies say Redis refused a command to this user (``adapters.intake``): the
sidecar then reads the plain way instead of failing every read."""

from __future__ import annotations

import pytest

from adapters.intake import permission_refused
from broker.resp import error_reply

REFUSED = [
    # a command sent by itself
    "NOPERM this user has no permissions to run the 'xread' command",
    # a command a script runs, on 6.2 and 7.0
    "ERR The user executing the script can't run this command or subcommand script: "
    "4ec939d36409b72e957b3bb862d3f0815d8bcf61, on @user_script:166.",
    # the same on 7.2 and later
    "ERR ACL failure in script: User 'reach-sidecar-echo' has no permissions to run the "
    "'time' command script: 4ec939d36409b72e957b3bb862d3f0815d8bcf61, on @user_script:35.",
]
NOT_REFUSED = [
    "NOGROUP No such key 'reach:q:{a-1}' or consumer group 'sidecar'",
    "WRONGTYPE Operation against a key holding the wrong kind of value",
    "NOSCRIPT No matching script. Please use EVAL.",
    "ERR Invalid stream ID specified as stream command argument",
    "LOADING Redis is loading the dataset in memory",  # unavailable, not refused
]


@pytest.mark.parametrize("message", REFUSED)
def test_a_refusal_is_one_in_every_form_redis_gives_it(message: str) -> None:
    assert permission_refused(error_reply(message))


@pytest.mark.parametrize("message", NOT_REFUSED)
def test_other_errors_are_not_refusals(message: str) -> None:
    assert not permission_refused(error_reply(message))


def test_a_reply_that_is_no_error_is_no_refusal() -> None:
    assert not permission_refused([b"0-0"]) and not permission_refused(None)
