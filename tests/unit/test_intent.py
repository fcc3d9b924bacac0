"""Intent routing's pure decisions (:mod:`broker.intent`): rules, the lexical scorer, cosine,
feedback blended in, the cheapest of the close, and ``intent_unmatched``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.governance import IntentRule, rule_problem
from broker.intent import (
    MAX_INTENT_CHARS,
    CapabilityProfile,
    IntentPolicy,
    IntentRules,
    LexicalScorer,
    approval_rate,
    blended,
    cosine,
    decide,
    profile_text,
    stem,
    tokens,
)

REFUND = "Refund or reimburse a customer's payment; money back for an order, today or later"
WEATHER = "Tell the weather forecast for today or tomorrow, for any city"
PROFILES = {
    "payment.refund": CapabilityProfile(
        "payment.refund",
        profile_text("payment.refund", [REFUND], ["I want a refund for order 42"]),
        cost=2.0,
        agents=("payments",),
    ),
    "weather.forecast": CapabilityProfile(
        "weather.forecast",
        profile_text("weather.forecast", [WEATHER], ["will it rain tomorrow?"]),
        cost=1.0,
        agents=("weather",),
    ),
}
POLICY = IntentPolicy()


def lexical_decision(intent: str, rules: list[IntentRule] | None = None, **approvals: float):
    scorer = LexicalScorer(PROFILES.values())
    return decide(
        intent, IntentRules(rules or []), scorer.similarities(intent), PROFILES, approvals, POLICY
    )


# -- the pitfall: both descriptions say "today" -----------------------------------------------


def test_reimbursed_today_goes_to_refunds_by_the_lexical_layer() -> None:
    decision = lexical_decision("can I get reimbursed today?")
    assert decision.layer == "semantic" and decision.scorer == "lexical"
    assert decision.capability == "payment.refund"
    assert decision.score >= POLICY.hit
    weather = dict(decision.candidates)["weather.forecast"]
    assert weather < POLICY.reject  # "today" alone says little: every description has it


def test_weather_today_goes_to_the_weather() -> None:
    decision = lexical_decision("what's the weather today?")
    assert decision.capability == "weather.forecast" and decision.score >= POLICY.hit


def test_reimbursed_today_goes_to_refunds_by_a_rule_guard_even_against_the_semantics() -> None:
    # a careless rule sends anything "today" to the weather; the guard above it wins
    rules = [
        IntentRule(match=r"\btoday\b", capability="weather.forecast", priority=1),
        IntentRule(match=r"\breimburs|\brefund", capability="payment.refund", priority=99),
    ]
    decision = lexical_decision("can I get reimbursed today?", rules)
    assert decision.layer == "rules" and decision.capability == "payment.refund"
    assert "priority 99" in decision.reason
    assert lexical_decision("what's the weather today?", rules).capability == "weather.forecast"


def test_a_rule_wins_over_a_semantic_hit() -> None:
    rules = [IntentRule(match="weather", capability="payment.refund")]
    decision = lexical_decision("what's the weather today?", rules)
    assert decision.layer == "rules" and decision.capability == "payment.refund"


def test_rules_are_case_insensitive_highest_priority_first_ties_by_order() -> None:
    rules = IntentRules(
        [
            IntentRule(match="pay", capability="a.first", priority=5),
            IntentRule(match="PAY", capability="a.second", priority=5),
            IntentRule(match="nothing", capability="a.top", priority=100),
            IntentRule(match="Payment", capability="a.low", priority=-1),
        ]
    )
    found = rules.match("my PAYMENT please")
    assert found is not None and found[1].capability == "a.first" and found[0] == 0
    assert rules.match("unrelated") is None


# -- the semantic layer -------------------------------------------------------------------------


def test_unrelated_text_is_unmatched_naming_the_nearest_candidates() -> None:
    decision = lexical_decision("is the bank open on sunday?")
    assert decision.capability is None
    assert decision.reason.startswith("intent_unmatched")
    assert "payment.refund" in decision.reason and "weather.forecast" in decision.reason
    assert len(decision.candidates) == 2


def test_no_capability_at_all_is_unmatched() -> None:
    decision = decide("refund me", IntentRules([]), {}, {}, {}, POLICY)
    assert decision.capability is None and decision.reason.startswith("intent_unmatched")


def test_between_reject_and_hit_the_cheapest_of_the_close_wins() -> None:
    profiles = {
        "a.pricey": CapabilityProfile("a.pricey", "x", cost=5.0),
        "a.cheap": CapabilityProfile("a.cheap", "x", cost=1.0),
        "a.far": CapabilityProfile("a.far", "x", cost=0.0),
    }
    sims = {"a.pricey": 0.72, "a.cheap": 0.69, "a.far": 0.6}
    decision = decide("anything", IntentRules([]), sims, profiles, {}, POLICY)
    assert decision.capability == "a.cheap"
    assert "cheapest" in decision.reason
    hit = decide("anything", IntentRules([]), {**sims, "a.pricey": 0.9}, profiles, {}, POLICY)
    assert hit.capability == "a.pricey"  # above intent_hit the best wins, whatever it costs


def test_bad_feedback_lowers_the_score_and_no_feedback_leaves_it() -> None:
    profile = PROFILES["payment.refund"]
    assert blended(0.8, profile, {}, POLICY) == 0.8
    assert blended(0.8, profile, {"payments": None}, POLICY) == 0.8
    assert blended(0.8, profile, {"payments": 0.0}, POLICY) == pytest.approx(0.72)
    assert blended(0.8, profile, {"payments": 1.0}, POLICY) == pytest.approx(0.82)


def test_bad_feedback_flips_two_close_capabilities() -> None:
    profiles = {
        "a.one": CapabilityProfile("a.one", "x", cost=1.0, agents=("one",)),
        "a.two": CapabilityProfile("a.two", "x", cost=1.0, agents=("two",)),
    }
    sims = {"a.one": 0.9, "a.two": 0.88}
    rules = IntentRules([])
    assert decide("x", rules, sims, profiles, {}, POLICY).capability == "a.one"
    flipped = decide("x", rules, sims, profiles, {"one": 0.0, "two": 1.0}, POLICY)
    assert flipped.capability == "a.two"


def test_approval_rate_counts_good_and_bad_and_ignores_the_rest() -> None:
    assert approval_rate([]) is None
    assert approval_rate([b"good 1 2", b"bad 3 4", b"bad", "good", b"junk", b"\xff"]) == 0.5


def test_the_step_reads_like_a_funnel_step() -> None:
    step = lexical_decision("can I get reimbursed today?").step()
    assert step["step"] == "intent" and step["kept"] == 1
    assert step["layer"] == "semantic" and step["capability"] == "payment.refund"
    assert set(step["candidates"]) == {"payment.refund", "weather.forecast"}
    assert list(step["excluded"]) == ["weather.forecast"]


def test_stems_and_tokens() -> None:
    assert stem("reimbursed") == stem("reimburse") == stem("reimbursing")
    assert stem("refunds") == stem("refunded") == "refund"
    assert tokens("Can I get THE refund, today?") == {"refund", "today"}


def test_cosine() -> None:
    assert cosine([1.0, 0.0], [1.0, 0.0]) == pytest.approx(1.0)
    assert cosine([1.0, 0.0], [0.0, 1.0]) == 0.0
    assert cosine([1.0, 0.0], [-1.0, 0.0]) == 0.0
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0
    assert cosine([1.0], [1.0, 2.0]) == 0.0
    assert cosine([float("inf")], [1.0]) == 0.0


# -- any input ----------------------------------------------------------------------------------

_rules = st.lists(
    st.builds(
        IntentRule,
        match=st.text(min_size=1, max_size=12).filter(
            lambda m: rule_problem(IntentRule(match=m, capability="a.b")) is None
        ),
        capability=st.text(max_size=20),
        priority=st.integers(-5, 5),
    ),
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(intent=st.text(max_size=3000), rules=_rules, approval=st.none() | st.floats(0, 1))
def test_any_intent_and_any_rules_decide_within_bounds(
    intent: str, rules: list[IntentRule], approval: float | None
) -> None:
    scorer = LexicalScorer(PROFILES.values())
    sims = scorer.similarities(intent)
    assert all(0.0 <= s <= 1.0 for s in sims.values())
    decision = decide(intent, IntentRules(rules), sims, PROFILES, {"payments": approval}, POLICY)
    assert 0.0 <= decision.score <= 1.0 and math.isfinite(decision.score)
    assert decision.capability is not None or decision.reason.startswith("intent_unmatched")
    assert len(decision.candidates) <= 3


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=8),
    b=st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=8),
)
def test_cosine_of_anything_is_within_bounds(a: list[float], b: list[float]) -> None:
    assert 0.0 <= cosine(a, b) <= 1.0


def test_only_the_start_of_a_long_intent_is_read() -> None:
    rules = IntentRules([IntentRule(match="refund", capability="payment.refund")])
    assert rules.match("x" * MAX_INTENT_CHARS + "refund") is None
