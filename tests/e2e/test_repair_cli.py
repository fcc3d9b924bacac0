"""The repair commands as an operator runs them: real ``agent-reach`` processes, real Redis."""

from __future__ import annotations

import json
import socket

import anyio
import msgspec
import pytest
from click.testing import CliRunner

from broker.client import Client
from broker.config import Settings
from broker.connection import Connection, open_connection
from broker.events import event_fields
from broker.stages import Stage
from broker.store import MessageStore
from tests.support.harness import collect_replies, eventually, running_dispatcher
from tests.support.processes import AGENT_REACH, process_env
from tests.support.repair import echo, everything, reaches, record_in, saturated, stage_of, unsure
from workers.cli import main
from workers.notifier import Notifier


async def cli(settings: Settings, *argv: str, answer: str | None = None) -> tuple[int, str]:
    """Run ``agent-reach`` with ``answer`` on its standard input; its exit code and output,
    which is never a traceback."""
    done = await anyio.run_process(
        [AGENT_REACH, *argv],
        input=None if answer is None else answer.encode(),
        env=process_env(settings),
        check=False,
    )
    out = (done.stdout + done.stderr).decode()
    assert "Traceback" not in out, out
    return done.returncode, out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["stuck", "--older-than", "5x"], "'5x' is not a duration: use a number with an optional"),
        (["stuck", "--stage", "BOGUS"], "'BOGUS' is not a stage; stages: ACCEPTED, WAITING"),
        (["stuck", "--stage", "succeeded"], "SUCCEEDED has ended: stuck lists work in flight"),
        (["replay"], "give message ids, --dlq or --stage: exactly one of them"),
        (["replay", "01A", "--dlq"], "give message ids, --dlq or --stage: exactly one of them"),
        (["replay", "--stage", "FAILED"], "FAILED cannot be replayed as a whole stage; use NEE"),
        (["resolve", "01A"], "give exactly one of --succeeded JSON and --failed REASON"),
        (["resolve", "01A", "--succeeded", "{}", "--failed", "x"], "give exactly one of"),
        (["resolve", "01A", "--succeeded", '{"a": '], "Invalid value for --succeeded: not JSON"),
        (["resolve", "01A", "--failed", " "], "Invalid value for --failed: give the reason"),
        (
            ["resolve", "01A", "--succeeded", "[" * 100 + "]" * 100],
            "Invalid value for --succeeded: JSON nested 100 levels deep; at most 64 levels",
        ),
        (["resolve", "01A", "--succeeded", "[" * 100_000], "nested 100000 levels deep"),
        (["dlq", "--count", "0"], "0 is not in the range 1<=x<=1000000"),
        (["replay", "01A", "--by", "", "--yes"], "Invalid value for '--by': give a name"),
        (["resolve", "01A", "--failed", "x", "--by", "a\nb"], "Invalid value for '--by'"),
        (["dlq", "--count", "9" * 23], "is not in the range 1<=x<=1000000"),
    ],
)
def test_bad_option_values_are_precise_usage_errors(argv: list[str], says: str) -> None:
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()), result.output


async def test_unknown_ids_are_named_exit_1_and_change_nothing(
    conn: Connection, settings: Settings
) -> None:
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION)
    before = await everything(conn)
    for argv in (
        ["replay", parked, "no-such-id", "--yes"],
        ["resolve", "no-such-id", "--failed", "gone"],
        ["cancel", "no-such-id"],
    ):
        code, out = await cli(settings, *argv)
        assert code == 1 and "unknown message id 'no-such-id'" in out, (argv, out)
    assert await everything(conn) == before


async def test_stuck_lists_work_in_flight_as_text_and_json(
    conn: Connection, settings: Settings
) -> None:
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reason="no answer")
    async with saturated(conn) as held:
        busy = await held.busy()
        queued = await held.queued()
        code, out = await cli(settings, "stuck", "--older-than", "0", "--json")
        assert code == 0, out
        listed = {m["id"]: m for m in json.loads(out)}
        code, out = await cli(settings, "stuck", "--older-than", "0s", "--stage", "waiting")
        assert code == 0 and queued in out and busy not in out and "LAST REASON" in out
        code, fresh = await cli(settings, "stuck")  # the default bound: 5 minutes
    assert set(listed) == {parked, busy, queued}
    assert listed[busy]["stage"] == "PROCESSING" and listed[busy]["instance"] == "a-1"
    assert listed[busy]["attempt"] == 1 and listed[busy]["age_s"] >= 0
    assert listed[parked]["last_reason"] == "no answer"
    assert set(listed[queued]) == {
        "id",
        "stage",
        "capability",
        "instance",
        "attempt",
        "age_s",
        "accepted_age_s",
        "last_reason",
    }
    assert code == 0 and "nothing in flight for 5m00s or more" in fresh


async def test_replay_asks_first_for_a_non_idempotent_agent(
    conn: Connection, settings: Settings
) -> None:
    async with unsure(conn) as pair:
        message_id = await pair.parked()
        before = await MessageStore(conn).get_timeline(message_id)
        code, out = await cli(settings, "replay", message_id, answer="n\n")
        assert code == 1, out
        assert "text.echo: served by non-idempotent a-1, a-2" in out
        assert "Replay anyway? [y/N]" in out and "not confirmed: nothing replayed" in out
        assert await MessageStore(conn).get_timeline(message_id) == before  # untouched
        code, out = await cli(settings, "replay", message_id, "--yes", "--by", "ops")
        assert code == 0, out
        assert "Replay anyway" not in out
        assert f"replayed  {message_id} (was NEEDS_CONFIRMATION)" in out
        (result,) = (await collect_replies(conn, pair.reply_to, 1)).values()
        code, again = await cli(settings, "replay", "--stage", "NEEDS_CONFIRMATION")
    assert result.stage is Stage.SUCCEEDED and pair.agent.log.calls[message_id] == 2
    assert code == 0 and "nothing to replay" in again
    timeline = await MessageStore(conn).get_timeline(message_id)
    assert "replayed by ops" in [e.reason for e in timeline]


async def test_replay_with_a_yes_answer_and_from_the_dead_letter_stream(
    conn: Connection, settings: Settings
) -> None:
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION)  # no instance serves it: asks
    code, out = await cli(settings, "replay", "--stage", "needs_confirmation", answer="y\n")
    assert code == 0, out
    assert "text.echo: no instance serving it is registered" in out
    assert f"replayed  {parked} (was NEEDS_CONFIRMATION)" in out
    assert await stage_of(conn, parked) is Stage.WAITING

    dead = await record_in(conn, Stage.DEAD, reason="gave up")
    done = await record_in(conn, Stage.SUCCEEDED)
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", b'{"capability": "Bad"}')

        async def rejected() -> bool:
            return int(await conn.call("XLEN", conn.keys.dlq)) == 2

        await eventually(rejected)
    code, out = await cli(settings, "replay", "--dlq", "--yes")
    assert code == 0, out
    assert f"replayed  {dead} (was DEAD)" in out
    assert "an invalid envelope cannot be replayed" in out and out.count("skipped") == 1
    assert await stage_of(conn, dead) is Stage.WAITING

    code, out = await cli(settings, "replay", done, "--yes")
    assert code == 1 and f"skipped   {done} is SUCCEEDED: it succeeded, not replayed" in out
    assert await stage_of(conn, done) is Stage.SUCCEEDED


async def test_resolve_and_cancel_tell_the_producer(conn: Connection, settings: Settings) -> None:
    client = Client(conn)
    reply_to = client.new_reply_stream()
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reply_to=reply_to)
    code, out = await cli(settings, "resolve", parked, "--succeeded", '{"ok": true}', "--by", "ops")
    assert code == 0 and f"{parked} SUCCEEDED: resolved by ops: succeeded" in out, out
    code, out = await cli(settings, "resolve", parked, "--failed", "late")
    assert code == 1
    assert f"{parked} is SUCCEEDED: only a NEEDS_CONFIRMATION message can be resolved" in out

    async with running_dispatcher(conn):
        waiting = await client.submit(echo(reply_to, "nobody.serves"))
        await reaches(conn, waiting, Stage.WAITING)
        code, out = await cli(settings, "cancel", waiting, "--by", "ops")
    assert code == 0 and f"{waiting} cancelled by ops (was WAITING)" in out, out
    code, out = await cli(settings, "cancel", waiting)
    assert code == 1
    assert f"{waiting} is CANCELLED: it has already ended; it cannot be cancelled" in out
    replies = await collect_replies(conn, reply_to, 2)
    assert replies[parked].stage is Stage.SUCCEEDED and replies[parked].result == {"ok": True}
    assert replies[waiting].stage is Stage.CANCELLED
    assert replies[waiting].error == "cancelled by ops"


async def test_dlq_shows_dead_letters_newest_last(conn: Connection, settings: Settings) -> None:
    async with running_dispatcher(conn):
        await conn.call("XADD", conn.keys.ingress, "*", "envelope", b'{"capability": "Bad"}')

        async def rejected() -> bool:
            return int(await conn.call("XLEN", conn.keys.dlq)) == 1

        await eventually(rejected)
    dead = await record_in(conn, Stage.DEAD, reason="gave up after 3 attempts")
    code, out = await cli(settings, "dlq", "--json")
    assert code == 0, out
    rejected_letter, dead_letter = json.loads(out)
    assert rejected_letter["stage"] == "REJECTED" and "capability" in rejected_letter["reason"]
    assert rejected_letter["raw"] == '{"capability": "Bad"}'
    assert (dead_letter["id"], dead_letter["stage"]) == (dead, "DEAD")
    assert dead_letter["reason"] == "gave up after 3 attempts"
    assert rejected_letter["ts_ms"] <= dead_letter["ts_ms"]
    code, out = await cli(settings, "dlq", "--count", "1", "--json")
    assert [letter["id"] for letter in json.loads(out)] == [dead]
    code, out = await cli(settings, "dlq")
    lines = out.splitlines()
    assert code == 0 and lines[0] == "2 dead letter(s), the newest 2:"
    assert "REJECTED" in lines[1] and dead in lines[2] and "gave up after 3 attempts" in lines[2]


async def test_dlq_shows_where_an_undeliverable_webhook_went(settings: Settings) -> None:
    hooks = msgspec.structs.replace(
        settings,
        webhook_secret="s3cret",
        callback_hosts=["127.0.0.1"],
        webhook_attempts=2,
        webhook_backoff_ms=10,
        webhook_timeout_s=1.0,
    )
    assert hooks.redis_url is not None
    url = "http://127.0.0.1:9/hook?token=t0p"  # the discard port: nothing listens
    async with open_connection(hooks, hooks.redis_url) as conn, anyio.create_task_group() as tg:
        body = b'{"id":"m-1","stage":"SUCCEEDED","result":1}'
        entry = ("id", "m-1", "url", url, "body", body, "attempt", 1)
        await conn.call("XADD", conn.keys.outbox, "*", *entry)
        await tg.start(Notifier(conn).run)

        async def dead_lettered() -> bool:
            return int(await conn.call("XLEN", conn.keys.dlq)) == 1

        await eventually(dead_lettered, timeout_s=20)
        tg.cancel_scope.cancel()
    code, out = await cli(settings, "dlq", "--json")
    (letter,) = json.loads(out)
    assert code == 0 and letter["reason"] == "callback_undeliverable"
    shown = "http://127.0.0.1:9/hook?token=<hidden>"  # a secret in a URL is not printed
    assert (letter["url"], letter["attempts"]) == (shown, 2) and letter["error"]
    code, out = await cli(settings, "dlq")
    assert f"webhook {shown} after 2 attempts: " in out and "t0p" not in out


async def test_what_anyone_may_write_is_shown_not_a_traceback(
    conn: Connection, settings: Settings
) -> None:
    """A dead letter and an event whose time no calendar holds, a record whose result is no
    JSON, a broadcast's children that are no list: whoever may write those keys (a sidecar's
    user may) wrote them. The operator's commands show them as they are."""
    await conn.call("XADD", conn.keys.dlq, "*", "id", "far", "reason", "r", "ts", "9" * 15)
    far_event = event_fields("instance.gone", "s", int("9" * 15))
    await conn.call("XADD", conn.fleet.events, "*", *[x for kv in far_event.items() for x in kv])
    spoiled = await record_in(conn, Stage.SUCCEEDED)
    await conn.call("HSET", conn.keys.record(spoiled), "result", b"not json")
    await conn.call("HSET", conn.keys.record(spoiled), "children", b"{garbage")
    shown = [
        await cli(settings, "dlq"),
        await cli(settings, "events"),
        await cli(settings, "trace", spoiled),
        await cli(settings, "trace", spoiled, "--json"),
    ]
    assert [code for code, _ in shown] == [0, 0, 0, 0], shown
    assert "@999999999999999" in shown[0][1] and "far" in shown[0][1]
    assert "@999999999999999" in shown[1][1]
    document = json.loads(shown[3][1].splitlines()[0])  # a warning may follow, on stderr
    assert document["result"] == {"unreadable": "not json"}


async def test_an_endpoint_whose_port_is_taken_says_so_in_one_line(settings: Settings) -> None:
    """A second gateway (or console, or metrics page) on a port in use: the address and why,
    one line and exit 1 — it was a traceback of uvicorn's start."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        code, out = await cli(settings, "a2a-gateway", "--port", str(port))
    finally:
        taken.close()
    assert code == 1
    assert f"Error: cannot listen on 127.0.0.1:{port}: Address already in use" in out


async def test_stored_text_reaches_the_terminal_escaped(
    conn: Connection, settings: Settings
) -> None:
    """A sidecar's user may write a timeline's reasons and a record's error: escape
    sequences in them were printed as they are, to retitle, clear or redraw the operator's
    terminal. trace, stuck and dlq now write them as escapes."""
    hostile = "no answer\x1b]0;pwned\x07\x1b[2J"
    parked = await record_in(conn, Stage.NEEDS_CONFIRMATION, reason=hostile)
    dead = await record_in(conn, Stage.DEAD, reason=hostile)
    outputs = [
        await cli(settings, "trace", parked),
        await cli(settings, "stuck", "--older-than", "0"),
        await cli(settings, "dlq"),
    ]
    assert dead  # dead-lettered, with the reason
    for code, out in outputs:
        assert code == 0, out
        assert "\x1b" not in out and "\x07" not in out
        assert "no answer\\x1b]0;pwned\\x07\\x1b[2J" in out
