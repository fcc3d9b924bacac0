"""The envelope: the one wire format between producers, the broker and agents.

An envelope is JSON in the ``envelope`` field of an ingress stream entry, so any language can
produce one with a raw ``XADD``. The payload is carried as :class:`msgspec.Raw`: the broker
never decodes it. Schema evolution adds defaulted fields only.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, Literal

import msgspec

from . import timekeeping
from .errors import InvalidEnvelope, quoted
from .headers import (
    headers_problem,
    idempotency_key_problem,
    traceparent_problem,
    tracestate_problem,
)
from .ids import new_message_id
from .jsondepth import MAX_JSON_DEPTH, decode_error_text, depth_problem
from .webhooks import MAX_URL_LENGTH

# `(?!\n)$`: Python's `$` also matches before a final newline; ECMA's (the schema's) does not.
CAPABILITY_PATTERN = r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)+(?!\n)$"
# Braces would break Redis Cluster hash tags in `reach:m:{<id>}`.
MESSAGE_ID_PATTERN = r"^[0-9A-Za-z_.:-]{1,128}(?!\n)$"

Capability = Annotated[str, msgspec.Meta(pattern=CAPABILITY_PATTERN, max_length=128)]
# Session ids become hash tags (`reach:s:{<session>}`): anything but braces and whitespace.
SessionId = Annotated[str, msgspec.Meta(pattern=r"^[^{}\s]{1,256}(?!\n)$")]
MessageId = Annotated[str, msgspec.Meta(pattern=MESSAGE_ID_PATTERN)]
Priority = Annotated[int, msgspec.Meta(ge=0, le=9)]
TimeoutS = Annotated[float, msgspec.Meta(gt=0, le=7 * 86400)]
MaxAttempts = Annotated[int, msgspec.Meta(ge=1, le=100)]
# Reply streams are key names: bounded, printable ASCII without spaces (decode_envelope).
MAX_REPLY_TO = 256
# Routing selectors: a few short words. Bounded so no envelope makes routing slow.
TagText = Annotated[str, msgspec.Meta(max_length=256)]
Tags = Annotated[dict[TagText, TagText], msgspec.Meta(max_length=64)]
ReplyTo = Annotated[str, msgspec.Meta(max_length=MAX_REPLY_TO)]
Target = Annotated[str, msgspec.Meta(pattern=MESSAGE_ID_PATTERN)]
CallbackUrl = Annotated[str, msgspec.Meta(max_length=MAX_URL_LENGTH)]
# Tenants label counters and name budget keys: a short printable word.
# printable ASCII, no spaces; not "-", which stands for no tenant in usage (broker.usage)
TENANT_PATTERN = r"^(?!-$)[\x21-\x7e]{1,128}(?!\n)$"
Tenant = Annotated[str, msgspec.Meta(pattern=TENANT_PATTERN)]
Intent = Annotated[str, msgspec.Meta(min_length=1, max_length=2048)]

_NULL = msgspec.Raw(b"null")


def _null_payload() -> msgspec.Raw:
    return _NULL


class Envelope(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request to run ``capability`` on ``payload``; see DESIGN §2 for each field.

    ``intent`` may stand in for ``capability``: the dispatcher maps it to one
    (:mod:`broker.intent`) before anything else reads the envelope, so every accepted
    envelope names its capability. ``tenant`` names who pays (usage, budgets, rate limits).
    ``budget_per_task`` caps the declared cost of the instance that may run it; ``budget``
    is its older name, read into it."""

    capability: Capability = ""
    payload: msgspec.Raw = msgspec.field(default_factory=_null_payload)
    id: MessageId | None = None
    tags: Tags = msgspec.field(default_factory=dict)
    target: Target | None = None
    session_id: SessionId | None = None
    mode: Literal["unicast", "broadcast"] = "unicast"
    priority: Priority = 0
    timeout_s: TimeoutS = 300.0
    idempotency_key: str | None = None
    reply_to: ReplyTo | None = None
    callback_url: CallbackUrl | None = None
    max_attempts: MaxAttempts = 3
    budget_per_task: Annotated[float, msgspec.Meta(ge=0)] | None = None
    budget: Annotated[float, msgspec.Meta(ge=0)] | None = None
    tenant: Tenant | None = None
    intent: Intent | None = None
    traceparent: str | None = None
    tracestate: str | None = None  # W3C Trace Context, with traceparent
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    created_at: float | None = None
    # Set by the broker on the children of a broadcast; a producer's envelope never has it.
    parent: MessageId | None = None

    def payload_json(self) -> Any:
        """The payload decoded from JSON (the broker itself never decodes it)."""
        return msgspec.json.decode(self.payload)

    @property
    def message_id(self) -> str:
        """The id, which every accepted envelope has (see :func:`complete`)."""
        assert self.id is not None, "envelope has not been accepted"
        return self.id

    def for_agent(self) -> Envelope:
        """The envelope as an agent gets it: its ``idempotency_key`` always there."""
        if self.idempotency_key is not None:
            return self
        return msgspec.structs.replace(self, idempotency_key=self.message_id)

    @property
    def idempotency(self) -> str:
        """The key an agent de-duplicates by: the producer's ``idempotency_key``, else the
        message id. An accepted envelope stores no key equal to its id (:func:`complete`):
        the record is ~47 bytes shorter for it (``python -m bench.memory``)."""
        return self.idempotency_key or self.message_id


CAPABILITY_RULE = (
    "capability must be lower-case, dot-separated `domain.action` (e.g. `payment.refund`),"
    " at most 128 characters"
)


def capability_problem(value: str) -> str | None:
    """Why ``value`` is not a valid capability name, or ``None`` when it is one."""
    try:
        msgspec.convert(value, Capability)
    except msgspec.ValidationError:
        return f"{quoted(value)}: {CAPABILITY_RULE}"
    return None


_STREAM_NAME = re.compile(r"[\x21-\x7e]+\Z")
_decoder = msgspec.json.Decoder(Envelope)
_encoder = msgspec.json.Encoder()


def decode_envelope(raw: bytes, *, max_bytes: int, reply_prefix: str) -> Envelope:
    """Decode and validate raw envelope bytes, or raise :class:`InvalidEnvelope` saying why."""
    if len(raw) > max_bytes:
        raise InvalidEnvelope(f"envelope is {len(raw)} bytes, over the {max_bytes}-byte limit", raw)
    if problem := _text_problem(raw):
        raise InvalidEnvelope(problem, raw)
    try:
        envelope = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidEnvelope(_describe_decode_error(decode_error_text(exc, raw)), raw) from exc
    except RecursionError as exc:  # msgspec gives up on very deep nesting, even in a Raw
        raise InvalidEnvelope("invalid JSON: nested too deeply", raw) from exc
    if envelope.reply_to is not None and not envelope.reply_to.startswith(reply_prefix):
        raise InvalidEnvelope(
            f"reply_to {envelope.reply_to!r} must start with {reply_prefix!r}", raw
        )
    if envelope.reply_to is not None and not _STREAM_NAME.match(envelope.reply_to):
        raise InvalidEnvelope(
            f"reply_to {envelope.reply_to!r} must be printable ASCII without spaces", raw
        )
    check_envelope(envelope, raw)
    if envelope.budget is not None:  # the older name of budget_per_task
        envelope.budget_per_task, envelope.budget = envelope.budget, None
    return envelope


def _text_problem(raw: bytes) -> str | None:
    """What in the envelope's text no agent should be handed: bytes that are not UTF-8 (the
    payload is carried as it came, undecoded), or nesting deeper than ``MAX_JSON_DEPTH``
    (the decoder, and many an agent's, would give up on it). The depth is measured only when
    there are brackets enough for it to matter: two C-speed counts on the common path."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"invalid JSON: not UTF-8 at byte {exc.start}"
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and (problem := depth_problem(raw)):
        return f"invalid JSON: {problem}"
    return None


def envelope_problem(envelope: Envelope) -> str | None:
    """Why an envelope that decoded cannot be carried to an agent (:mod:`broker.headers`),
    or ``None``: the rules msgspec's types cannot state."""
    if not envelope.capability and envelope.intent is None:
        return "invalid envelope: a capability (or an intent) is required - at `$.capability`"
    if envelope.budget is not None and envelope.budget_per_task is not None:
        return "invalid envelope: budget is the older name of budget_per_task: give one"
    if problem := headers_problem(envelope.headers):
        return f"invalid envelope: {problem}"
    if envelope.traceparent is not None and (problem := traceparent_problem(envelope.traceparent)):
        return f"invalid envelope: {problem}"
    if envelope.tracestate is not None and (problem := tracestate_problem(envelope.tracestate)):
        return f"invalid envelope: {problem}"
    key = envelope.idempotency_key
    if key is not None and (problem := idempotency_key_problem(key)):
        return f"invalid envelope: {problem}"
    return None


def check_envelope(envelope: Envelope, raw: bytes = b"") -> None:
    """Raise :class:`InvalidEnvelope` with :func:`envelope_problem`'s reason, if any."""
    if problem := envelope_problem(envelope):
        raise InvalidEnvelope(problem, raw)


def _describe_decode_error(text: str) -> str:
    if text.startswith(("JSON is malformed", "Input data was truncated")):
        return f"invalid JSON: {text}"
    if "matching regex" in text and text.endswith("`$.capability`"):
        return f"invalid envelope: {CAPABILITY_RULE} - at `$.capability`"
    return f"invalid envelope: {text}"


def complete(envelope: Envelope, *, now_s: float | None = None) -> Envelope:
    """Fill what the broker owns at acceptance: ``id`` and ``created_at``. A missing
    ``idempotency_key`` stays missing: it is the id (:attr:`Envelope.idempotency`)."""
    message_id = envelope.id or new_message_id()
    return msgspec.structs.replace(
        envelope,
        id=message_id,
        created_at=envelope.created_at
        if envelope.created_at is not None
        else (now_s if now_s is not None else timekeeping.now_s()),
    )


class _ReplyToOnly(msgspec.Struct):
    reply_to: str | None = None


_reply_to_decoder = msgspec.json.Decoder(_ReplyToOnly)


def stored_reply_to(raw: bytes) -> str:
    """The ``reply_to`` of an envelope a record stores ("" when it names none, or when the
    bytes are not an envelope). A record keeps no copy of its own of what its accepted
    envelope says (:mod:`broker.record_codec`)."""
    try:
        return _reply_to_decoder.decode(raw).reply_to or ""
    except (msgspec.DecodeError, RecursionError):
        return ""


_sorted_encoder = msgspec.json.Encoder(order="sorted")


def request_fingerprint(envelope: Envelope) -> bytes:
    """What makes two envelopes under one id the same request: every field but ``id``, the
    ways of telling the producer (``reply_to``, ``callback_url``), its trace context and its
    clock (``created_at``) — a retry from a new client legitimately changes those. A missing
    key counts as the id it stands for (:attr:`Envelope.idempotency`), as versions that
    filled it in sent and stored it: their digests and ours agree. The payload counts as
    JSON, not as bytes: ``{"a": 1}`` and ``{"a":1}`` are the same request."""
    return _sorted_encoder.encode(
        msgspec.structs.replace(
            envelope,
            id=None,
            idempotency_key=envelope.idempotency_key or envelope.id,
            reply_to=None,
            callback_url=None,
            traceparent=None,
            tracestate=None,
            created_at=None,
            payload=_canonical(envelope.payload),
        )
    )


def _canonical(payload: msgspec.Raw) -> msgspec.Raw:
    """The payload re-encoded with sorted keys and no spacing (as it came if it cannot be:
    accepted payloads can, as the depth was checked at acceptance)."""
    try:
        return msgspec.Raw(_sorted_encoder.encode(msgspec.json.decode(payload)))
    except (msgspec.DecodeError, RecursionError):
        return payload


def request_digest(envelope: Envelope) -> str:
    """A short digest of :func:`request_fingerprint`: what a refusal of this very request
    (``id_conflict``) names, so that only its own producer takes the refusal as its answer."""
    return hashlib.blake2b(request_fingerprint(envelope), digest_size=12).hexdigest()


def encode_envelope(envelope: Envelope) -> bytes:
    """JSON bytes of an envelope, with the reused encoder."""
    return _encoder.encode(envelope)


def load_envelope(data: bytes) -> Envelope:
    """Decode an envelope the broker itself stored (already validated)."""
    return _decoder.decode(data)


def envelope_schema() -> dict[str, Any]:
    """The published JSON Schema of the envelope."""
    schema: dict[str, Any] = msgspec.json.schema(Envelope)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Agent-Reach envelope"
    body = schema["$defs"]["Envelope"]
    body["properties"]["capability"].pop("default", None)  # "" stands for "not given"
    body["anyOf"] = [{"required": ["capability"]}, {"required": ["intent"]}]
    return schema


def salvage_reply_to(raw: bytes, reply_prefix: str) -> str | None:
    """Best effort: the ``reply_to`` of an envelope that failed validation, if it is usable."""
    value = _salvage_field(raw, "reply_to")
    if not isinstance(value, str) or not value.startswith(reply_prefix):
        return None
    # the rules a valid envelope's reply_to is held to: a key name, bounded, printable
    return value if len(value) <= MAX_REPLY_TO and _STREAM_NAME.match(value) else None


def salvage_id(raw: bytes) -> str | None:
    """Best effort: the ``id`` of an envelope that failed validation, if it is a valid id."""
    value = _salvage_field(raw, "id")
    try:
        return msgspec.convert(value, MessageId) if value is not None else None
    except msgspec.ValidationError:
        return None


def _salvage_field(raw: bytes, name: str) -> Any:
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return None
    return data.get(name) if isinstance(data, dict) else None
