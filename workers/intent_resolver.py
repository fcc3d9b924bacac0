"""The dispatcher's intent router: envelopes that name an ``intent`` and no capability get one
before admission (:mod:`broker.intent` decides; this module feeds it and carries it out).

Per registry snapshot (:meth:`IntentResolver.load`, with each refresh of the routing table):
each capability's profile (its instances' descriptions and examples, its cheapest declared
cost, its agents), the lexical scorer built over them, and the agents' approval rates read
from ``P:fb:{<agent>}`` — never per message. Per batch: the rules, then one call to the
embeddings endpoint for every intent the rules left (when ``embedding_url`` is set; on any
failure the lexical scorer answers, and the decision says so). An envelope naming both a
capability and an intent keeps its capability: the intent is not read.

A resolved envelope carries its capability from then on (its record, retries and drains
never resolve it again); the decision is the first step of its ``route_from`` and the start
of its ``route_reason``. An unmatched intent is REJECTED ``intent_unmatched`` like any refused
entry (:meth:`workers.intake.Intake.reject`): a record, a dead letter, a reply naming the
nearest candidates.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from broker.config import Settings
from broker.connection import Connection
from broker.envelope import Envelope, capability_problem, encode_envelope
from broker.feedback import approvals
from broker.intent import (
    CapabilityProfile,
    IntentDecision,
    IntentPolicy,
    IntentRules,
    LexicalScorer,
    decide,
    profile_text,
)
from broker.routing import RegistryIndex
from broker.wire import route_from_json, route_steps

from .intake import Intake, Rejection
from .intent_embeddings import EmbeddingFailure, EmbeddingScorer

log = logging.getLogger("agent_reach.intent")


def intent_policy(settings: Settings) -> IntentPolicy:
    return IntentPolicy(
        hit=settings.intent_hit,
        reject=settings.intent_reject,
        close=settings.intent_close,
        feedback_weight=settings.intent_feedback_weight,
    )


def profiles_of(index: RegistryIndex) -> dict[str, CapabilityProfile]:
    """Each registered capability's profile, from its instances' cards."""
    profiles = {}
    for capability, views in index.by_capability.items():
        cards = [v.card for v in views]
        text = profile_text(
            capability,
            [c.description for c in cards if c.description],
            [e for c in cards for e in c.examples],
        )
        cost = min(c.cost for c in cards)
        agents = tuple(dict.fromkeys(c.agent_id for c in cards))
        profiles[capability] = CapabilityProfile(capability, text, cost, agents)
    return profiles


def with_intent(fields: Mapping[str, Any], reason: str, intent: IntentDecision) -> dict[str, Any]:
    """A routing decision's record fields with the intent decision in front: the first step
    of ``route_from``, the start of ``route_reason`` (and of the acceptance's reason)."""
    steps = route_steps(fields.get("route_from"))
    return {
        **fields,
        "route_from": route_from_json([intent.step(), *steps]),
        "route_reason": f"{intent.reason}; {fields.get('route_reason', reason)}",
    }


@dataclass(slots=True)
class Resolved:
    """A batch after intent routing: what goes on to admission, and the decisions taken."""

    envelopes: list[Envelope]
    decisions: dict[str, IntentDecision] = field(default_factory=dict)


# after the embeddings endpoint failed, intents are scored lexically this long before it is
# asked again (each batch waiting up to embedding_timeout_s would slow every ingress lane)
EMBEDDINGS_REST_S = 30.0


class IntentResolver:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        settings = conn.settings
        self.rules = IntentRules(settings.intent_rules)
        self.policy = intent_policy(settings)
        self.embeddings = (
            EmbeddingScorer(
                settings.embedding_url, settings.embedding_model, settings.embedding_timeout_s
            )
            if settings.embedding_url
            else None
        )
        self.profiles: dict[str, CapabilityProfile] = {}
        self.lexical = LexicalScorer([])
        self.approvals: dict[str, float | None] = {}
        self._snapshot: RegistryIndex | None = None
        self._built: object = None  # the snapshot the profiles were built from
        self._intents_seen = False
        self._embeddings_back_at = 0.0  # after a failure, the lexical scorer until then
        self._embeddings_failure = ""

    async def load(self, index: RegistryIndex) -> None:
        """A new snapshot. Profiles, the lexical scorer and the agents' approval rates are
        (re)built from it only once intents are in use: a dispatcher that never meets one
        pays nothing per refresh."""
        self._snapshot = index
        if self._intents_seen:
            await self._build()

    async def _build(self) -> None:
        index = self._snapshot
        if index is None or index is self._built:
            return
        profiles = profiles_of(index)
        agents = {a for p in profiles.values() for a in p.agents}
        self.approvals = await approvals(self.conn, agents)
        if profiles != self.profiles:
            self.profiles, self.lexical = profiles, LexicalScorer(profiles.values())
        self._built = index

    async def aclose(self) -> None:
        if self.embeddings is not None:
            await self.embeddings.aclose()

    async def resolve(self, envelopes: Sequence[Envelope], intake: Intake) -> Resolved:
        """Each intent-only envelope mapped to a capability, or rejected (through ``intake``)
        as ``intent_unmatched``; the others passed on untouched, in order."""
        asked = [e for e in envelopes if not e.capability and e.intent]
        if not asked:
            return Resolved(list(envelopes))
        self._intents_seen = True
        await self._build()
        decisions = await self.decide([e.intent or "" for e in asked])
        by_id = {e.message_id: d for e, d in zip(asked, decisions, strict=True)}
        kept: list[Envelope] = []
        rejections: list[Rejection] = []
        for envelope in envelopes:
            decision = by_id.get(envelope.message_id)
            if decision is None:
                kept.append(envelope)
            elif decision.capability is None:
                rejections.append(_rejection(envelope, decision.reason, intake))
            else:
                kept.append(msgspec.structs.replace(envelope, capability=decision.capability))
        await intake.reject(rejections)
        return Resolved(kept, {k: d for k, d in by_id.items() if d.capability is not None})

    async def decide(self, intents: list[str]) -> list[IntentDecision]:
        """The decision for each intent: rules, else the semantic layer (one embeddings call
        for the lot, or the lexical scorer)."""
        unruled = [i for i in intents if self.rules.match(i) is None]
        scored, scorer = await self._similarities(unruled)
        decisions = []
        for intent in intents:
            similarities = scored.get(intent, {})
            decision = decide(
                intent,
                self.rules,
                similarities,
                self.profiles,
                self.approvals,
                self.policy,
                scorer=scorer,
            )
            decisions.append(_checked(decision))
        return decisions

    async def _similarities(self, intents: list[str]) -> tuple[dict[str, dict[str, float]], str]:
        distinct = list(dict.fromkeys(intents))
        if not distinct:
            return {}, "lexical"
        scorer = "lexical"
        resting = anyio.current_time() < self._embeddings_back_at
        if self.embeddings is not None and self.profiles and resting:
            scorer = f"lexical; embeddings unavailable: {self._embeddings_failure}"
        elif self.embeddings is not None and self.profiles:
            try:
                found = await self.embeddings.similarities(distinct, list(self.profiles.values()))
                return dict(zip(distinct, found, strict=True)), "embeddings"
            except EmbeddingFailure as exc:
                # not asked again for a while: a stalled endpoint must not slow every batch
                log.warning("embeddings unavailable, intents scored lexically: %s", exc)
                self._embeddings_failure = str(exc)[:200]
                self._embeddings_back_at = anyio.current_time() + EMBEDDINGS_REST_S
                scorer = f"lexical; embeddings unavailable: {self._embeddings_failure}"
        return {i: self.lexical.similarities(i) for i in distinct}, scorer


def _checked(decision: IntentDecision) -> IntentDecision:
    """A rule naming what is no capability (config says ``capability = "Refund"``) maps
    nothing: refused with the reason, not routed to a name no instance can have."""
    if decision.capability is not None and (problem := capability_problem(decision.capability)):
        reason = f"intent_unmatched: {decision.reason}, which is no capability: {problem}"
        return IntentDecision(decision.layer, None, decision.score, reason, decision.scorer)
    return decision


def _rejection(envelope: Envelope, reason: str, intake: Intake) -> Rejection:
    return Rejection(
        message_id=envelope.message_id,
        reason=reason,
        raw=encode_envelope(envelope),
        reply_to=envelope.reply_to or "",
        source=f"{intake.stream} intent",
    )
