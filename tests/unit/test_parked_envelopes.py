"""The bounds of the envelopes a dispatcher keeps of what it parked."""

from __future__ import annotations

from broker.envelope import Envelope
from broker.stages import Stage
from workers.parked_envelopes import ParkedEnvelopes


def envelope(n: int, priority: int = 0) -> Envelope:
    return Envelope(capability="text.echo", id=f"m{n}", priority=priority)


def test_what_is_kept_reads_as_the_record_acceptance_wrote() -> None:
    parked = ParkedEnvelopes()
    parked.keep("text.echo", envelope(1, priority=5), accepted_ms=1_000, size=100)
    kept = parked.get("m1")
    assert kept is not None and kept.envelope.message_id == "m1"
    record = kept.record()
    assert (record.id, record.stage, record.attempt, record.avoid, record.retry_at_ms) == (
        "m1",
        Stage.WAITING,
        0,
        "",
        0,
    )
    assert (record.capability, record.priority, record.accepted_ms) == ("text.echo", 5, 1_000)


def test_past_the_count_new_parks_are_not_kept_and_the_oldest_stay() -> None:
    parked = ParkedEnvelopes(max_kept=2)
    for n in range(3):
        parked.keep("text.echo", envelope(n), accepted_ms=1_000 + n, size=10)
    assert (len(parked), parked.get("m0") is not None, parked.get("m2")) == (2, True, None)
    parked.drop("m0")
    parked.keep("text.echo", envelope(3), accepted_ms=1_003, size=10)
    assert parked.get("m3") is not None and len(parked) == 2


def test_past_the_bytes_a_park_is_not_kept_until_others_go() -> None:
    parked = ParkedEnvelopes(max_bytes=100)
    parked.keep("text.echo", envelope(1), accepted_ms=1_000, size=60)
    parked.keep("text.echo", envelope(2), accepted_ms=1_000, size=60)
    assert parked.get("m2") is None
    parked.drop("m1")
    parked.keep("text.echo", envelope(2), accepted_ms=1_000, size=60)
    assert parked.get("m2") is not None


def test_kept_twice_counts_once() -> None:
    parked = ParkedEnvelopes(max_bytes=100)
    for _ in range(3):
        parked.keep("text.echo", envelope(1), accepted_ms=1_000, size=60)
    assert len(parked) == 1
    parked.drop("m1")
    parked.keep("text.echo", envelope(2), accepted_ms=1_000, size=100)
    assert parked.get("m2") is not None


def test_a_park_past_the_bounds_lets_go_of_an_earlier_envelope_under_its_id() -> None:
    """The id parked again (its record purged, the id reused) when the bounds are full: the
    new envelope is not kept, and the old one must not stand in for it at the drain."""
    parked = ParkedEnvelopes(max_bytes=100)
    parked.keep("text.echo", envelope(1), accepted_ms=1_000, size=60)
    parked.keep("text.echo", envelope(2), accepted_ms=1_000, size=30)
    reused = Envelope(capability="text.other", id="m1")
    parked.keep("text.other", reused, accepted_ms=1_001, size=200)  # past the bytes alone
    assert parked.get("m1") is None and len(parked) == 1


def test_what_was_parked_longer_ago_than_it_is_kept_goes() -> None:
    parked = ParkedEnvelopes(keep_s=1.0)
    parked.keep("text.echo", envelope(1), accepted_ms=1_000, size=10)
    parked.keep("text.echo", envelope(2), accepted_ms=1_500, size=10)
    parked.expire(2_001)
    assert (parked.get("m1"), parked.get("m2") is not None) == (None, True)
    parked.keep("text.echo", envelope(3), accepted_ms=2_600, size=10)  # a park expires too
    assert (parked.get("m2"), len(parked)) == (None, 1)


def test_dropping_what_is_not_kept_changes_nothing() -> None:
    parked = ParkedEnvelopes(max_bytes=10)
    parked.drop("m1")
    parked.keep("text.echo", envelope(1), accepted_ms=1_000, size=10)
    assert parked.get("m1") is not None
