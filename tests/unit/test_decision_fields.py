"""What a record keeps of a routing decision: the funnel's bytes are the same whichever way
they are made (a funnel that excluded no one is encoded once and kept)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.routing_types import Decision, Outcome, Step
from broker.wire import route_from_json, route_steps
from workers.assignment import decision_fields

names = st.text(min_size=1, max_size=12)
steps = st.builds(
    Step,
    name=names,
    kept=st.integers(min_value=0, max_value=10_000),
    excluded=st.lists(st.tuples(names, names), max_size=2),
    more=st.integers(min_value=0, max_value=3),
)


@given(st.lists(steps, max_size=6), st.text(max_size=20))
def test_the_funnel_is_written_as_the_decision_says(funnel: list[Step], reason: str) -> None:
    decision = Decision(Outcome.NO_FREE_CREDIT, None, reason, funnel)
    fields = decision_fields(decision)
    assert fields == {"route_from": route_from_json(decision.route_from()), "route_reason": reason}
    assert route_steps(fields["route_from"]) == route_steps(route_from_json(decision.route_from()))


def test_a_funnel_that_excluded_no_one_is_kept_and_one_that_did_is_not_confused_with_it() -> None:
    plain = Decision(Outcome.ROUTED, None, "", [Step("capability", 3), Step("healthy", 2)])
    assert decision_fields(plain)["route_from"] == b'["capability:3","healthy:2"]'
    assert decision_fields(plain)["route_from"] is decision_fields(plain)["route_from"]
    excluded = Decision(
        Outcome.ROUTED, None, "", [Step("capability", 3), Step("healthy", 2, [("a-1", "down")])]
    )
    assert decision_fields(excluded)["route_from"] == (
        b'["capability:3",{"step":"healthy","kept":2,"excluded":{"a-1":"down"}}]'
    )
