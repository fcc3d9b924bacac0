"""Intent routing: an envelope's free-text ``intent`` mapped to a capability. Pure.

Two layers, asked in order:

1. **rules** — ``intent_rules`` from config, each ``{match, capability, priority}``: the
   regex is searched case-insensitively in the intent; of the rules that match, the highest
   ``priority`` wins, ties going to the one listed first. A rule that answers always wins.
2. **semantic** — the intent compared with each registered capability's *profile*: its
   name, and the descriptions and examples its instances' cards carry (``agent-reach sidecar
   --describe/--example``). A scorer gives a similarity in 0..1 per capability: the built-in
   :class:`LexicalScorer`, or the cosine of embedding vectors (:func:`cosine`, the vectors
   fetched by ``workers/intent_embeddings.py``). The agents' recent approval (``agent-reach
   feedback``) enters with weight ``w`` = ``intent_feedback_weight``::

       score = (1 - w) × similarity + w × approval

   where approval is the share of good ratings among the recent ratings of the capability's
   agents (their mean); with no ratings at all the score is the similarity itself (no
   evidence neither raises nor lowers it). Then, with the best score ``s``:
   ``s ≥ intent_hit`` routes to the best; ``intent_reject ≤ s < intent_hit`` routes to the
   cheapest (lowest declared instance ``cost``) of the candidates within ``intent_close`` of
   ``s``; ``s < intent_reject`` is ``intent_unmatched``, naming the nearest candidates.

Every intent is untrusted text: only its first ``MAX_INTENT_CHARS`` characters are read.
The rules' regexes come from config only (checked at load, :func:`broker.governance.rule_problem`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .governance import IntentRule, rule_pattern

MAX_INTENT_CHARS = 1024  # of an intent, only this much is read (rules and scorers alike)
MAX_TEXT_CHARS = 8192  # of a capability's profile text, likewise
MAX_TOKENS = 256  # distinct words of one text compared
NEAREST = 3  # candidates named by a decision
UNMATCHED = "intent_unmatched"

Layer = Literal["rules", "semantic"]

_WORD = re.compile(r"[a-z0-9]+")
# words that say nothing about what is asked: they never count, on either side
STOP_WORDS = frozenset(
    """a about after all also am an and any are as at be been before being but by can could
    did do does doing for from get got had has have having he her here hers him his how i if
    in into is it its just let me might more most must my no not now of off on once only or
    our ours out over please she should so some such than that the their them then there these
    they this those through to too under until up us very want was we were what when where
    which while who whom why will with would you your yours s t d ll m re ve""".split()
)
# suffixes folded so that "reimbursed", "reimburse" and "reimbursing" compare equal
_SUFFIXES = ("ments", "ment", "ings", "ing", "ies", "ed", "es", "s", "e", "ly")


def stem(word: str) -> str:
    """A crude stemmer: up to two common English suffixes off, keeping at least 3 letters.
    Crude is enough: both sides of a comparison are stemmed alike."""
    for _ in range(2):
        for suffix in _SUFFIXES:
            if word.endswith(suffix) and len(word) - len(suffix) >= 3:
                word = word[: -len(suffix)]
                break
        else:
            break
    return word


def tokens(text: str) -> frozenset[str]:
    """The distinct stemmed words of ``text`` that are not stop words: at most
    ``MAX_TOKENS``, from its first ``MAX_TEXT_CHARS`` characters."""
    words = _WORD.findall(text[:MAX_TEXT_CHARS].lower())
    found: dict[str, None] = {}
    for word in words:
        if word not in STOP_WORDS:
            found[stem(word)] = None
            if len(found) >= MAX_TOKENS:
                break
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class CapabilityProfile:
    """What the semantic layer knows of a capability: the text it is compared on, the
    cheapest declared cost among its instances, and the agents serving it."""

    capability: str
    text: str
    cost: float = 0.0
    agents: tuple[str, ...] = ()


def profile_text(capability: str, descriptions: Iterable[str], examples: Iterable[str]) -> str:
    """A capability's text: its name's words (``payment.refund`` → payment refund), its
    descriptions, its examples."""
    name = capability.replace(".", " ").replace("_", " ").replace("-", " ")
    return "\n".join([name, *dict.fromkeys(descriptions), *dict.fromkeys(examples)])


# -- rules -------------------------------------------------------------------------------------


class IntentRules:
    """``intent_rules``, compiled once, in the order they are asked (highest priority first,
    ties by config order)."""

    def __init__(self, rules: Sequence[IntentRule]) -> None:
        ranked = sorted(enumerate(rules), key=lambda pair: (-pair[1].priority, pair[0]))
        self.ranked = [(i, rule, rule_pattern(rule)) for i, rule in ranked]

    def match(self, intent: str) -> tuple[int, IntentRule] | None:
        """The winning rule (with its index in config), or ``None``."""
        text = intent[:MAX_INTENT_CHARS]
        for index, rule, pattern in self.ranked:
            if pattern.search(text):
                return index, rule
        return None


# -- scorers -------------------------------------------------------------------------------------


class LexicalScorer:
    """Word overlap weighted by rarity among the capabilities' texts; needs nothing.

    With ``N`` profiles and ``df(t)`` the number whose text holds word ``t``, a word weighs
    ``idf(t) = ln((N + 1) / df(t))``: a word every profile holds ("today") weighs
    ``ln(1 + 1/N)``, little; a word one profile holds weighs ``ln(N + 1)``. A word of the
    intent no profile holds weighs ``ln(N + 1) / 2``: it is evidence the intent asks for
    something none of them offers. The similarity of intent ``I`` to capability ``c`` is the
    share of the intent's weight its text explains::

        sim(I, c) = Σ idf(t) for t in I ∩ words(c)  /  Σ idf(t) for t in I

    1.0 when every informative word of the intent is in the capability's text, 0 when none
    is (or the intent has no informative word)."""

    def __init__(self, profiles: Iterable[CapabilityProfile]) -> None:
        self.words = {p.capability: tokens(p.text) for p in profiles}
        count = len(self.words)
        frequency: dict[str, int] = {}
        for words in self.words.values():
            for word in words:
                frequency[word] = frequency.get(word, 0) + 1
        self.idf = {w: math.log((count + 1) / df) for w, df in frequency.items()}
        self.unknown = math.log(count + 1) / 2

    def similarities(self, intent: str) -> dict[str, float]:
        asked = tokens(intent[:MAX_INTENT_CHARS])
        weights = {w: self.idf.get(w, self.unknown) for w in asked}
        total = sum(weights.values())
        if total <= 0:
            return dict.fromkeys(self.words, 0.0)
        return {
            capability: _unit(sum(weights[w] for w in asked & words) / total)
            for capability, words in self.words.items()
        }


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine of two vectors, as a similarity in 0..1 (opposite and orthogonal alike
    count as unrelated); 0 for a zero vector or vectors of different lengths."""
    if len(a) != len(b) or not a:
        return 0.0
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    if not norm or not math.isfinite(norm) or not math.isfinite(dot):
        return 0.0
    return _unit(dot / norm)


def _unit(value: float) -> float:
    return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0


# -- feedback --------------------------------------------------------------------------------


def approval_rate(ratings: Iterable[bytes | str]) -> float | None:
    """The share of ``good`` among an agent's recent ratings (``P:fb:{agent}`` entries,
    ``"good …"`` or ``"bad …"``); ``None`` with none. Anything else in the list is ignored."""
    good = bad = 0
    for rating in ratings:
        text = rating.decode(errors="replace") if isinstance(rating, bytes) else rating
        if text.startswith("good"):
            good += 1
        elif text.startswith("bad"):
            bad += 1
    return good / (good + bad) if good + bad else None


def capability_approval(
    profile: CapabilityProfile, approvals: Mapping[str, float | None]
) -> float | None:
    """The mean approval of the capability's rated agents; ``None`` when none is rated."""
    rated = [a for agent in profile.agents if (a := approvals.get(agent)) is not None]
    return sum(rated) / len(rated) if rated else None


# -- the decision ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class IntentPolicy:
    hit: float = 0.85
    reject: float = 0.55
    close: float = 0.05
    feedback_weight: float = 0.1


@dataclass(frozen=True, slots=True)
class IntentDecision:
    """How an intent was mapped: by which layer (and scorer), to what (``None``: unmatched),
    with which score, among which candidates (nearest first), and why."""

    layer: Layer
    capability: str | None
    score: float
    reason: str
    scorer: str = ""
    candidates: list[tuple[str, float]] = field(default_factory=list)

    def step(self) -> dict[str, Any]:
        """The decision as a funnel step on ``route_from`` (what ``agent-reach trace``
        prints: kept, and the candidates not taken with their scores)."""
        out: dict[str, Any] = {"step": "intent", "kept": int(self.capability is not None)}
        excluded = {c: f"score {s:.2f}" for c, s in self.candidates if c != self.capability}
        if excluded:
            out["excluded"] = excluded
        out |= {"layer": self.layer, "score": round(self.score, 4)}
        if self.scorer:
            out["scorer"] = self.scorer
        out["capability"] = self.capability
        out["candidates"] = {c: round(s, 4) for c, s in self.candidates}
        return out


def decide(
    intent: str,
    rules: IntentRules,
    similarities: Mapping[str, float],
    profiles: Mapping[str, CapabilityProfile],
    approvals: Mapping[str, float | None],
    policy: IntentPolicy,
    *,
    scorer: str = "lexical",
) -> IntentDecision:
    """Rules first; else the semantic layer over ``similarities`` (capability → 0..1, from
    ``scorer``), blended with ``approvals`` (agent → approval rate)."""
    ruled = rules.match(intent)
    if ruled is not None:
        index, rule = ruled
        reason = (
            f"intent rule {index} ({rule.match!r}, priority {rule.priority}) -> {rule.capability}"
        )
        return IntentDecision("rules", rule.capability, 1.0, reason)
    ranked = sorted(
        ((c, blended(s, profiles.get(c), approvals, policy)) for c, s in similarities.items()),
        key=lambda pair: (-pair[1], pair[0]),
    )
    nearest = ranked[:NEAREST]
    if not ranked or ranked[0][1] < policy.reject:
        return IntentDecision(
            "semantic",
            None,
            ranked[0][1] if ranked else 0.0,
            _unmatched(nearest, policy, scorer),
            scorer,
            nearest,
        )
    best_capability, best = ranked[0]
    if best >= policy.hit:
        why = f"score {best:.2f} >= intent_hit {policy.hit}"
        return _semantic(best_capability, best, why, scorer, nearest)
    close = [(c, s) for c, s in ranked if s >= max(best - policy.close, policy.reject)]
    cost = {c: profiles[c].cost if c in profiles else 0.0 for c, _ in close}
    chosen, score = min(close, key=lambda pair: (cost[pair[0]], -pair[1], pair[0]))
    why = (
        f"score {score:.2f} between intent_reject {policy.reject} and intent_hit {policy.hit}: "
        f"the cheapest (cost {cost[chosen]:g}) of {len(close)} within intent_close {policy.close}"
    )
    return _semantic(chosen, score, why, scorer, _with(nearest, chosen, score))


def blended(
    similarity: float,
    profile: CapabilityProfile | None,
    approvals: Mapping[str, float | None],
    policy: IntentPolicy,
) -> float:
    approval = capability_approval(profile, approvals) if profile is not None else None
    similarity = _unit(similarity)
    if approval is None:
        return similarity
    w = policy.feedback_weight
    return _unit((1 - w) * similarity + w * approval)


def _semantic(
    capability: str, score: float, why: str, scorer: str, nearest: list[tuple[str, float]]
) -> IntentDecision:
    reason = f"intent -> {capability} by the semantic layer ({scorer}): {why}"
    return IntentDecision("semantic", capability, score, reason, scorer, nearest)


def _with(
    nearest: list[tuple[str, float]], capability: str, score: float
) -> list[tuple[str, float]]:
    """The nearest candidates, the chosen one among them even when it ranked lower."""
    if any(c == capability for c, _ in nearest):
        return nearest
    return [*nearest, (capability, score)]


def _unmatched(nearest: list[tuple[str, float]], policy: IntentPolicy, scorer: str) -> str:
    if not nearest:
        return f"{UNMATCHED}: no registered capability to compare the intent with"
    listed = ", ".join(f"{c} ({s:.2f})" for c, s in nearest)
    return (
        f"{UNMATCHED}: no capability scored intent_reject {policy.reject} or more "
        f"({scorer}); nearest: {listed}"
    )
