"""The A2A gateway's task ids prove they are its own (workers/gateway_ids.py)."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from broker.envelope import MESSAGE_ID_PATTERN
from workers.gateway_ids import mint_task_id, minted_here

SECRET = b"s" * 64


def test_a_minted_id_is_the_gateways_and_no_other_is() -> None:
    minted = mint_task_id(SECRET)
    assert minted_here(SECRET, minted)
    assert not minted_here(b"another secret", minted)
    flipped = minted[:-1] + ("0" if minted[-1] != "0" else "1")
    assert not minted_here(SECRET, flipped)
    nonce, mac = minted.removeprefix("a2a-").split("-")
    assert not minted_here(SECRET, f"a2a-{nonce}-{'é' * len(mac)}")  # no TypeError: False
    assert not minted_here(SECRET, f"a2a-{nonce}")
    assert not minted_here(SECRET, f"x2a-{nonce}-{mac}")


def test_minted_ids_are_message_ids_and_differ() -> None:
    ids = {mint_task_id(SECRET) for _ in range(100)}
    assert len(ids) == 100
    assert all(re.match(MESSAGE_ID_PATTERN, i) for i in ids)


@given(st.text(max_size=80))
def test_any_text_is_judged_without_raising(task_id: str) -> None:
    assert minted_here(SECRET, task_id) is False
