"""The console's pure rules: who is let in, which forms count, where it may listen, and the
overview's rates — and the ``console`` command's refusals, before it connects anywhere."""

from __future__ import annotations

import anyio
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from workers.cli import main
from workers.console.app import sample_forever
from workers.console.history import History
from workers.console.security import Guard, bind_refusal, cross_site, token_problem
from workers.overview import Overview

TOKEN = "a-console-token-of-32-characters"


def test_without_a_token_only_loopback_names_are_let_in() -> None:
    guard = Guard(token=None)

    allowed = [h for h in ("127.0.0.1:8700", "localhost", "[::1]:8700") if guard.host_allowed(h)]
    refused = [h for h in ("evil.example:8700", "10.0.0.5", "") if not guard.host_allowed(h)]

    assert len(allowed) == 3 and len(refused) == 3
    assert guard.session(None, None) is not None


def test_with_a_token_a_bearer_or_the_login_cookie_opens_a_session() -> None:
    guard = Guard(token=TOKEN)
    cookie = guard.login(TOKEN)

    assert guard.session(None, None) is None
    assert guard.session(f"Bearer {TOKEN}x", None) is None
    assert guard.login("wrong") is None
    assert cookie is not None and TOKEN not in cookie
    assert guard.session(None, cookie) == cookie == guard.session(f"Bearer {TOKEN}", None)
    assert guard.session(None, Guard(token=TOKEN).cookie_value) is None  # another secret


def test_a_csrf_token_serves_its_own_session_only() -> None:
    guard = Guard(token=TOKEN)

    assert guard.csrf_ok("session-a", guard.csrf("session-a"))
    assert not guard.csrf_ok("session-b", guard.csrf("session-a"))
    assert not guard.csrf_ok("session-a", None) and not guard.csrf_ok("session-a", "")


def test_the_browser_says_when_a_form_comes_from_another_site() -> None:
    host = "127.0.0.1:8700"

    assert not cross_site(None, None, host)  # a script: the CSRF token decides
    assert not cross_site("http://127.0.0.1:8700", "same-origin", host)
    assert cross_site("http://evil.example", None, host)
    assert cross_site("null", None, host)
    assert cross_site(None, "cross-site", host) and cross_site(None, "same-site", host)


@given(st.text(max_size=300), st.text(max_size=300) | st.none(), st.text(max_size=100))
def test_the_origin_check_never_raises(origin: str, fetch_site: str | None, host: str) -> None:
    assert cross_site(origin, fetch_site, host) in (True, False)


def test_listening_off_loopback_needs_a_good_token() -> None:
    assert bind_refusal("127.0.0.1", None) is None and bind_refusal("::1", None) is None
    assert "off loopback" in (bind_refusal("0.0.0.0", None) or "")
    assert bind_refusal("0.0.0.0", TOKEN) is None
    assert token_problem("short") and token_problem("x" * 15 + " y") and not token_problem(TOKEN)


def test_the_console_command_refuses_an_open_address_before_connecting() -> None:
    runner = CliRunner()
    # a Redis URL nothing listens on: the refusal must come first
    redis = ["--redis", "redis://127.0.0.1:1/0"]

    open_to_all = runner.invoke(main, ["console", *redis, "--host", "0.0.0.0"], env={})
    weak = runner.invoke(main, ["console", *redis, "--host", "0.0.0.0", "--token", "short"])
    up = runner.invoke(main, ["up", *redis, "--console", "--console-host", "0.0.0.0"], env={})

    assert open_to_all.exit_code == 2 and "off loopback" in open_to_all.output
    assert weak.exit_code == 2 and "at least 16 characters" in weak.output
    assert up.exit_code == 2 and "off loopback" in up.output


def reading(at_ms: int, accepted: int, succeeded: int) -> Overview:
    totals = {"accepted": accepted, "SUCCEEDED": succeeded, "FAILED": 0}
    return Overview(at_ms, totals, [], [], 0, 0)


def test_rates_come_from_consecutive_readings_and_a_clock_step_back_is_ignored() -> None:
    history = History(keep=3)
    for at_ms, accepted, succeeded in [(0, 0, 0), (1000, 10, 4), (500, 99, 99), (3000, 30, 24)]:
        history.add(reading(at_ms, accepted, succeeded))

    rates = history.rates()
    chart = history.chart(width=100, height=50)

    assert [t for t, _ in rates] == [1000, 3000]
    assert rates[0][1] == {"accepted": 10.0, "SUCCEEDED": 4.0, "FAILED": 0.0}
    assert rates[1][1] == {"accepted": 10.0, "SUCCEEDED": 10.0, "FAILED": 0.0}
    assert chart.peak == 10.0 and chart.lines["accepted"] == "M0.0,0.0 L100.0,0.0"


def test_no_rate_is_counted_across_an_outage_or_a_total_that_fell_the_chart_breaks() -> None:
    history = History()
    history.add(reading(0, 0, 0))
    history.add(reading(1000, 10, 10))
    history.lost()  # Redis away for a minute
    history.add(reading(61_000, 70, 70))
    history.add(reading(62_000, 80, 80))
    history.add(reading(63_000, 3, 3))  # it came back without its data: the counts restarted
    history.add(reading(64_000, 13, 13))

    runs = history.segments()
    chart = history.chart(width=64, height=10)

    assert [[t for t, _ in run] for run in runs] == [[1000], [62_000], [64_000]]
    assert all(r["accepted"] == 10.0 for run in runs for _, r in run)  # never 1.0 across it
    assert chart.lines["accepted"] == "M0.0,0.0 M62.0,0.0 M64.0,0.0"


class FailingOnce:
    """A reading that fails as a defect (not Redis away) once, then succeeds."""

    def __init__(self) -> None:
        self.samples = 0
        self.gaps = 0
        self.again = anyio.Event()

    async def sample(self) -> None:
        self.samples += 1
        if self.samples == 1:
            raise OverflowError("int too large to convert to float")
        self.again.set()

    def lost(self) -> None:
        self.gaps += 1


async def test_a_reading_that_fails_is_a_gap_not_the_end_of_the_console() -> None:
    state = FailingOnce()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_forever, state)
        with anyio.fail_after(10):
            await state.again.wait()
        tg.cancel_scope.cancel()
    assert (state.samples, state.gaps) == (2, 1)


def test_host_and_origin_headers_that_do_not_parse_are_refused_not_a_500() -> None:
    """`Host: [::1` raised ValueError inside the guard: a 500 and a traceback per request."""
    guard = Guard(token=None)

    assert not any(guard.host_allowed(h) for h in ("[::1", "[", "a]", "[x]"))
    assert all(cross_site(o, None, "127.0.0.1:8700") for o in ("http://[::1", "http://[x]"))
