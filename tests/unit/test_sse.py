"""Server-sent events as the adapters read them (adapters/sse.py, a2a_stream, mcp_wire)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import msgspec
from hypothesis import given
from hypothesis import strategies as st

from adapters.a2a_stream import StreamReading, read_event
from adapters.a2a_wire import push_state
from adapters.mcp_wire import answer_of
from adapters.sse import MAX_EVENT_BYTES, sse_data


async def events_of(body: bytes, chunk: int = 7) -> list[bytes]:
    """The events of ``body`` read as it arrives ``chunk`` bytes at a time."""

    async def arriving() -> AsyncIterator[bytes]:
        for i in range(0, len(body), chunk):
            yield body[i : i + chunk]

    response = httpx.Response(200, content=arriving())
    return [data async for data in sse_data(response)]


lines = st.lists(
    st.one_of(
        st.just(b""),
        st.just(b": ping"),
        st.just(b"event: message"),
        st.binary(max_size=30).map(lambda b: b"data: " + b.replace(b"\n", b"").replace(b"\r", b"")),
    ),
    max_size=12,
)


@given(lines=lines, ends=st.sampled_from([b"\n", b"\r\n", b"\r"]), chunk=st.integers(1, 40))
def test_the_events_are_the_same_however_the_stream_is_cut(
    lines: list[bytes], ends: bytes, chunk: int
) -> None:
    body = b"".join(line + ends for line in lines)
    whole = anyio.run(events_of, body, len(body) + 1)
    assert anyio.run(events_of, body, chunk) == whole
    expected, data = [], []
    for line in lines:  # the rule, line by line
        if line.startswith(b"data:"):
            data.append(line[5:].lstrip(b" "))
        elif not line and data:
            expected.append(b"\n".join(data))
            data = []
        elif not line:
            data = []
    assert whole == expected


async def test_a_line_separator_inside_json_does_not_cut_an_event() -> None:
    event = msgspec.json.encode({"text": "line\u2028two\u2029three\x85four"})
    assert b"\xe2\x80\xa8" in event  # written unescaped, as JSON allows
    body = b": ping\r\n\r\ndata: " + event + b"\r\n\r\ndata: 2\n\n"
    assert await events_of(body) == [event, b"2"]


async def test_an_event_over_the_limit_is_skipped_and_the_next_one_read() -> None:
    huge = b"data: " + b"x" * (MAX_EVENT_BYTES + 10) + b"\n\n"
    for chunk in (65536, 1000, len(huge)):  # the line cut anywhere, or read whole
        assert await events_of(huge + b"data: {}\n\n", chunk=chunk) == [b"{}"]
    at_the_limit = b"data: " + b"x" * (MAX_EVENT_BYTES - 6)  # the line exactly the limit
    assert await events_of(at_the_limit + b"\n\n", chunk=4096) == [b"x" * (MAX_EVENT_BYTES - 6)]


def test_0_3_events_and_pushes_are_read_as_1_0_ones() -> None:
    reading = StreamReading()
    update = {"kind": "status-update", "taskId": "t", "status": {"state": "working"}}
    said = read_event(msgspec.json.encode({"result": update}), reading)
    assert said == "working" and reading.task_id == "t"
    final = {**update, "status": {"state": "completed"}}
    read_event(msgspec.json.encode({"result": final}), reading)
    assert reading.final_state == "completed"
    bare_task = {"kind": "task", "id": "t", "status": {"state": "failed"}}
    assert push_state(msgspec.json.encode(bare_task)) == ("t", "failed")


def test_an_mcp_answer_holding_a_line_separator_is_read() -> None:
    answer = {"jsonrpc": "2.0", "id": 3, "result": {"content": [{"text": "a\u2028b"}]}}
    body = b"event: message\r\ndata: " + msgspec.json.encode(answer) + b"\r\n\r\n"
    assert answer_of("text/event-stream", body, 3) == answer
