"""The envelope codec: validation with precise reasons, raw payloads, completion, the schema."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.envelope import (
    Envelope,
    complete,
    decode_envelope,
    encode_envelope,
    envelope_schema,
    load_envelope,
    request_fingerprint,
    salvage_id,
    salvage_reply_to,
    stored_reply_to,
)
from broker.errors import InvalidEnvelope
from broker.headers import is_reserved

PREFIX = "reach:reply:"
LIMIT = 64 * 1024
ULID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")
PROPERTY = settings(database=None, suppress_health_check=[HealthCheck.too_slow])


def decode(raw: bytes, *, max_bytes: int = LIMIT) -> Envelope:
    return decode_envelope(raw, max_bytes=max_bytes, reply_prefix=PREFIX)


def reason_for(raw: bytes, *, max_bytes: int = LIMIT) -> str:
    with pytest.raises(InvalidEnvelope) as info:
        decode(raw, max_bytes=max_bytes)
    assert info.value.raw is raw
    assert str(info.value) == info.value.reason
    return info.value.reason


def envelope_bytes(**fields: Any) -> bytes:
    return json.dumps({"capability": "text.echo", **fields}).encode()


# -- decoding ---------------------------------------------------------------------------------


def test_minimal_envelope_gets_every_default() -> None:
    envelope = decode(b'{"capability":"text.echo"}')

    assert envelope.capability == "text.echo"
    assert bytes(envelope.payload) == b"null"
    assert envelope.payload_json() is None
    assert envelope.id is None
    assert envelope.idempotency_key is None
    assert envelope.created_at is None
    assert envelope.mode == "unicast"
    assert envelope.priority == 0
    assert envelope.timeout_s == 300.0
    assert envelope.max_attempts == 3
    assert envelope.tags == {}
    assert envelope.headers == {}
    assert envelope.reply_to is None


@pytest.mark.parametrize("capability", ["a.b", "payment.refund", "x1.y_2.z-3", "text.echo.v2"])
def test_well_formed_capabilities_are_accepted(capability: str) -> None:
    assert decode(envelope_bytes(capability=capability)).capability == capability


def test_reply_to_under_the_prefix_is_accepted() -> None:
    assert decode(envelope_bytes(reply_to=PREFIX + "me")).reply_to == PREFIX + "me"


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"not json", b'{"capability":"a.b"} trailing', b"\xff\xfe", b'{"capability":'],
)
def test_invalid_json_is_named(raw: bytes) -> None:
    assert reason_for(raw).startswith("invalid JSON")


def test_a_lone_surrogate_in_the_payload_is_named() -> None:
    reason = reason_for(b'{"capability": "a.b", "payload": {"text": "\\ud83d"}}')

    assert reason.startswith("invalid JSON: JSON is malformed: a lone UTF-16 surrogate \\ud83d")


@pytest.mark.parametrize("raw", [b"{}", b'{"priority":1}'])
def test_missing_capability_is_named(raw: bytes) -> None:
    reason = reason_for(raw)
    assert "capability" in reason
    assert not reason.startswith("invalid JSON")


@pytest.mark.parametrize("capability", ["Text", "text", "text.", "a..b", ".a.b", "a.B", "1a.b"])
def test_malformed_capability_explains_domain_action(capability: str) -> None:
    reason = reason_for(envelope_bytes(capability=capability))
    assert "domain.action" in reason
    assert "$.capability" in reason


def test_unknown_field_is_named() -> None:
    reason = reason_for(envelope_bytes(colour="blue"))
    assert "unknown field" in reason
    assert "colour" in reason


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"capability": 7}, "$.capability"),
        ({"priority": "1"}, "$.priority"),
        ({"priority": 1.5}, "$.priority"),
        ({"tags": {"a": 1}}, "$.tags"),
        ({"tags": ["a"]}, "$.tags"),
        ({"headers": {"a": None}}, "$.headers"),
        ({"timeout_s": "soon"}, "$.timeout_s"),
        ({"max_attempts": True}, "$.max_attempts"),
        ({"mode": "multicast"}, "$.mode"),
        ({"reply_to": 3}, "$.reply_to"),
        ({"id": 12}, "$.id"),
    ],
)
def test_wrong_types_name_the_field(fields: dict[str, Any], path: str) -> None:
    reason = reason_for(envelope_bytes(**fields))
    assert reason.startswith("invalid envelope")
    assert path in reason


@pytest.mark.parametrize("priority", [-1, 10, 100])
def test_priority_out_of_range_is_rejected(priority: int) -> None:
    reason = reason_for(envelope_bytes(priority=priority))
    assert "$.priority" in reason


@pytest.mark.parametrize("priority", [0, 9])
def test_priority_bounds_are_inclusive(priority: int) -> None:
    assert decode(envelope_bytes(priority=priority)).priority == priority


@pytest.mark.parametrize(
    "fields",
    [
        {"timeout_s": 0},
        {"timeout_s": 7 * 86400 + 1},
        {"max_attempts": 0},
        {"max_attempts": 101},
        {"budget": -0.5},
        {"id": "has{brace}"},
        {"id": ""},
        {"id": "x" * 129},
        {"capability": "a." + "b" * 127},
    ],
)
def test_other_constraints_are_enforced(fields: dict[str, Any]) -> None:
    assert reason_for(envelope_bytes(**fields)).startswith("invalid envelope")


def test_oversize_envelope_names_both_sizes() -> None:
    raw = envelope_bytes(payload="x" * 100)
    reason = reason_for(raw, max_bytes=len(raw) - 1)
    assert str(len(raw)) in reason
    assert str(len(raw) - 1) in reason


def test_envelope_of_exactly_the_limit_is_accepted() -> None:
    raw = envelope_bytes(payload="x" * 100)
    assert decode(raw, max_bytes=len(raw)).capability == "text.echo"


def test_size_is_checked_before_parsing() -> None:
    raw = b"not json at all"
    assert "bytes" in reason_for(raw, max_bytes=3)


@pytest.mark.parametrize("reply_to", ["other:reply:x", "reach:reply", "", "REACH:REPLY:x"])
def test_reply_to_outside_the_prefix_is_rejected(reply_to: str) -> None:
    reason = reason_for(envelope_bytes(reply_to=reply_to))
    assert "reply_to" in reason
    assert PREFIX in reason


# -- the payload stays raw --------------------------------------------------------------------

ODD_PAYLOAD = b'{ "b" :[1,  2.50 ,"\\u00e9", 1e3,{}] ,"a":null }'


def test_payload_is_raw_bytes_exactly_as_sent() -> None:
    raw = b'{"capability":"text.echo","payload":' + ODD_PAYLOAD + b"}"
    envelope = decode(raw)

    assert isinstance(envelope.payload, msgspec.Raw)
    assert bytes(envelope.payload) == ODD_PAYLOAD
    assert envelope.payload_json() == {"b": [1, 2.5, "é", 1000.0, {}], "a": None}


def test_payload_round_trips_byte_identical() -> None:
    raw = b'{"capability":"text.echo","payload":' + ODD_PAYLOAD + b',"priority":4}'
    stored = encode_envelope(complete(decode(raw), now_s=1.0))
    loaded = load_envelope(stored)

    assert ODD_PAYLOAD in stored
    assert bytes(loaded.payload) == ODD_PAYLOAD
    assert loaded.priority == 4
    assert encode_envelope(loaded) == stored


# -- completion at acceptance -----------------------------------------------------------------


def test_complete_fills_id_and_time_and_the_key_is_the_id() -> None:
    envelope = complete(decode(b'{"capability":"text.echo"}'), now_s=1234.5)

    assert envelope.id is not None
    assert ULID.match(envelope.id)
    assert envelope.message_id == envelope.id
    assert envelope.idempotency == envelope.id
    assert envelope.created_at == 1234.5
    # the key is not stored when it is the id: the record is that much shorter
    assert b"idempotency_key" not in encode_envelope(envelope)


def test_a_key_equal_to_the_id_is_the_same_request_as_none() -> None:
    bare = complete(decode(envelope_bytes(id="order-9")), now_s=1.0)
    keyed = complete(decode(envelope_bytes(id="order-9", idempotency_key="order-9")), now_s=1.0)
    other = complete(decode(envelope_bytes(id="order-9", idempotency_key="k-2")), now_s=1.0)

    assert request_fingerprint(bare) == request_fingerprint(keyed)
    assert request_fingerprint(bare) != request_fingerprint(other)


def test_complete_keeps_what_the_producer_gave() -> None:
    given_fields = envelope_bytes(id="order-7", idempotency_key="k-1", created_at=5.0)
    envelope = complete(decode(given_fields), now_s=99.0)

    assert envelope.id == "order-7"
    assert envelope.idempotency_key == "k-1"
    assert envelope.idempotency == "k-1"
    assert envelope.created_at == 5.0


def test_complete_keeps_a_zero_created_at() -> None:
    assert complete(decode(envelope_bytes(created_at=0.0)), now_s=99.0).created_at == 0.0


def test_complete_key_defaults_to_a_given_id() -> None:
    envelope = complete(decode(envelope_bytes(id="order-8")), now_s=1.0)
    assert envelope.idempotency == "order-8"


def test_complete_uses_the_clock_without_now() -> None:
    before = time.time()
    envelope = complete(decode(b'{"capability":"text.echo"}'))
    after = time.time()

    assert envelope.created_at is not None
    assert before <= envelope.created_at <= after


def test_complete_gives_distinct_ids() -> None:
    base = decode(b'{"capability":"text.echo"}')
    assert len({complete(base, now_s=1.0).message_id for _ in range(200)}) == 200


def test_message_id_requires_acceptance() -> None:
    with pytest.raises(AssertionError):
        _ = decode(b'{"capability":"text.echo"}').message_id


# -- the published schema ---------------------------------------------------------------------


def schema_validator() -> jsonschema.protocols.Validator:
    schema = envelope_schema()
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def test_schema_is_draft_2020_12_with_defs() -> None:
    schema = envelope_schema()

    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "Agent-Reach envelope"
    assert schema["$ref"] == "#/$defs/Envelope"
    body = schema["$defs"]["Envelope"]
    assert body.get("required", []) == []
    assert body["anyOf"] == [{"required": ["capability"]}, {"required": ["intent"]}]
    assert body["additionalProperties"] is False
    assert set(body["properties"]) == set(Envelope.__struct_fields__)
    assert jsonschema.validators.validator_for(schema) is jsonschema.Draft202012Validator


def test_schema_is_a_fresh_dict_each_time() -> None:
    first = envelope_schema()
    first["title"] = "changed"
    assert envelope_schema()["title"] == "Agent-Reach envelope"


GOOD = {
    "capability": "payment.refund",
    "payload": {"order": 7, "lines": [1, 2]},
    "id": "order-7",
    "tags": {"team": "billing"},
    "mode": "broadcast",
    "priority": 9,
    "timeout_s": 30.5,
    "reply_to": PREFIX + "me",
    "max_attempts": 5,
    "budget": 0,
    "headers": {"x": "y"},
    "created_at": 1.5,
}


def test_schema_accepts_a_good_envelope() -> None:
    schema_validator().validate(GOOD)
    decode(json.dumps(GOOD).encode())  # and the decoder agrees


@pytest.mark.parametrize(
    "change",
    [
        {"capability": "Payment.Refund"},
        {"capability": "payment"},
        {"priority": 10},
        {"priority": "1"},
        {"timeout_s": 0},
        {"mode": "multicast"},
        {"tags": {"a": 1}},
        {"id": "a{b}"},
        # $ matches before a final line break in Python's re (which msgspec uses): the
        # session id becomes a hash tag, the tenant a counter's label and a budget's key
        {"session_id": "abc\n"},
        {"tenant": "acme\n"},
        {"max_attempts": 0},
        {"unknown": True},
    ],
)
def test_schema_rejects_what_the_decoder_rejects(change: dict[str, Any]) -> None:
    bad = {**GOOD, **change}
    with pytest.raises(jsonschema.ValidationError):
        schema_validator().validate(bad)
    with pytest.raises(InvalidEnvelope):
        decode(json.dumps(bad).encode())


def test_schema_requires_capability() -> None:
    bad = {k: v for k, v in GOOD.items() if k != "capability"}
    with pytest.raises(jsonschema.ValidationError):
        schema_validator().validate(bad)


# -- salvaging a rejected envelope ------------------------------------------------------------

GARBAGE = [b"", b"\xff", b"{", b"[]", b"null", b'"reach:reply:x"', b"42", b"{}", b'{"a":1}']


@pytest.mark.parametrize("raw", GARBAGE)
def test_salvage_on_garbage_gives_none(raw: bytes) -> None:
    assert salvage_reply_to(raw, PREFIX) is None
    assert salvage_id(raw) is None


def test_salvage_reply_to() -> None:
    assert salvage_reply_to(b'{"reply_to":"reach:reply:me","x":[', PREFIX) is None
    assert salvage_reply_to(b'{"capability":"Bad","reply_to":"reach:reply:me"}', PREFIX) == (
        "reach:reply:me"
    )
    assert salvage_reply_to(b'{"reply_to":"elsewhere:me"}', PREFIX) is None
    assert salvage_reply_to(b'{"reply_to":["reach:reply:me"]}', PREFIX) is None
    assert salvage_reply_to(b'{"reply_to":null}', PREFIX) is None
    # held to a valid reply_to's rules: a 2 MB or non-ASCII key name is no place to answer
    long = b'{"reply_to":"reach:reply:' + b"x" * 2_000_000 + b'"}'
    assert salvage_reply_to(long, PREFIX) is None
    assert salvage_reply_to('{"reply_to":"reach:reply:ü"}'.encode(), PREFIX) is None
    assert salvage_reply_to(b'{"reply_to":"reach:reply:a b"}', PREFIX) is None


def test_salvage_id() -> None:
    assert salvage_id(b'{"capability":"Bad","id":"order-7"}') == "order-7"
    assert salvage_id(b'{"id":"a{b}"}') is None
    assert salvage_id(b'{"id":""}') is None
    assert salvage_id(b'{"id":7}') is None
    assert salvage_id(b'{"id":null}') is None
    assert salvage_id(json.dumps({"id": "x" * 129}).encode()) is None


# -- properties -------------------------------------------------------------------------------

segment = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)
capabilities = st.lists(segment, min_size=2, max_size=4).map(".".join)
message_ids = st.from_regex(r"[0-9A-Za-z_.:-]{1,40}", fullmatch=True)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=12,
)
str_maps = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=4)
optional_text = st.none() | st.text(max_size=20)
printable = st.from_regex(r"[!-~]([ -~]{0,18}[!-~])?", fullmatch=True)
header_names = st.from_regex(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,20}", fullmatch=True).filter(
    lambda name: not is_reserved(name)
)
header_maps = st.dictionaries(
    header_names, st.from_regex(r"[\t -~]{0,20}", fullmatch=True), max_size=4
).filter(lambda headers: len({name.lower() for name in headers}) == len(headers))
hex_digits = "0123456789abcdef"
traceparents = st.builds(
    lambda trace, parent, flags: f"00-{trace}-{parent}-{flags}",
    st.text(hex_digits, min_size=32, max_size=32).filter(lambda t: set(t) != {"0"}),
    st.text(hex_digits, min_size=16, max_size=16).filter(lambda p: set(p) != {"0"}),
    st.text(hex_digits, min_size=2, max_size=2),
)

valid_fields = st.fixed_dictionaries(
    {"capability": capabilities},
    optional={
        "payload": json_values,
        "id": st.none() | message_ids,
        "tags": str_maps,
        "target": st.none() | message_ids,
        "session_id": st.none() | st.from_regex(r"[^{}\s]{1,40}", fullmatch=True),
        "mode": st.sampled_from(["unicast", "broadcast"]),
        "priority": st.integers(0, 9),
        "timeout_s": st.floats(min_value=0, max_value=7 * 86400, exclude_min=True),
        "idempotency_key": st.none() | printable,
        "reply_to": st.none()
        | st.from_regex(r"[!-~]{0,10}", fullmatch=True).map(lambda s: PREFIX + s),
        "callback_url": optional_text,
        "max_attempts": st.integers(1, 100),
        "budget_per_task": st.none() | st.floats(min_value=0, allow_infinity=False),
        "tenant": st.none()
        | st.from_regex(r"[!-~]{1,20}", fullmatch=True).filter(lambda t: t != "-"),
        "intent": st.none() | st.text(min_size=1, max_size=40),
        "traceparent": st.none() | traceparents,
        "headers": header_maps,
        "created_at": st.none() | st.floats(allow_nan=False, allow_infinity=False),
    },
)


@PROPERTY
@given(fields=valid_fields, indent=st.none() | st.integers(0, 2))
def test_any_valid_fields_round_trip(fields: dict[str, Any], indent: int | None) -> None:
    raw = json.dumps(fields, indent=indent).encode()
    envelope = decode(raw, max_bytes=len(raw))

    for name, value in fields.items():
        if name == "payload":
            assert envelope.payload_json() == value
        else:
            assert getattr(envelope, name) == value, name

    stored = encode_envelope(envelope)
    loaded = load_envelope(stored)
    assert loaded == envelope
    assert bytes(loaded.payload) == bytes(envelope.payload)
    assert encode_envelope(loaded) == stored
    assert decode(stored) == envelope


@PROPERTY
@given(fields=valid_fields, now=st.floats(min_value=0, max_value=2e9))
def test_complete_then_store_round_trips(fields: dict[str, Any], now: float) -> None:
    envelope = complete(decode(json.dumps(fields).encode()), now_s=now)
    loaded = load_envelope(encode_envelope(envelope))

    assert loaded == envelope
    if fields.get("id") is not None:
        assert loaded.id == fields["id"]
    else:
        assert ULID.match(loaded.message_id)
    assert loaded.idempotency == (fields.get("idempotency_key") or loaded.id)
    expected_created = fields.get("created_at")
    assert loaded.created_at == (now if expected_created is None else expected_created)


field_names = st.sampled_from([*Envelope.__struct_fields__, "extra", ""])
json_objects = st.dictionaries(field_names, json_values, max_size=6)
inputs = (
    st.binary(max_size=200)
    | json_objects.map(lambda d: json.dumps(d).encode())
    | valid_fields.map(lambda d: json.dumps(d).encode())
    | st.tuples(valid_fields, st.integers(0, 40)).map(lambda t: json.dumps(t[0]).encode()[: t[1]])
)


@PROPERTY
@given(raw=inputs, max_bytes=st.sampled_from([16, 64, LIMIT]))
def test_arbitrary_bytes_only_ever_raise_invalid_envelope(raw: bytes, max_bytes: int) -> None:
    try:
        envelope = decode(raw, max_bytes=max_bytes)
    except InvalidEnvelope as exc:
        assert exc.raw is raw
        assert exc.reason
    else:
        assert isinstance(envelope, Envelope)
        assert len(raw) <= max_bytes


@PROPERTY
@given(raw=inputs)
def test_salvage_never_raises(raw: bytes) -> None:
    reply_to = salvage_reply_to(raw, PREFIX)
    assert reply_to is None or reply_to.startswith(PREFIX)
    message_id = salvage_id(raw)
    # Braces in an id would break the `{id}` hash tag of its keys.
    assert message_id is None or not {"{", "}", " "} & set(message_id)


def test_deeply_nested_json_is_rejected_not_a_crash() -> None:
    raw = b'{"capability":"a.b","payload":' + b"[" * 1000 + b"]" * 1000 + b"}"
    with pytest.raises(InvalidEnvelope, match="JSON nested 1001 levels deep; at most 64"):
        decode_envelope(raw, max_bytes=1 << 20, reply_prefix="reach:reply:")
    # within the limit it is carried as it came
    fine = b'{"capability":"a.b","payload":' + b"[" * 63 + b"]" * 63 + b"}"
    decode_envelope(fine, max_bytes=1 << 20, reply_prefix="reach:reply:")
    assert salvage_id(b'{"id":' + b"[" * 5000 + b"]" * 5000 + b"}") is None


def test_bytes_that_are_not_utf8_are_rejected_even_in_the_payload() -> None:
    raw = b'{"capability":"a.b","payload":"' + b"\xff" + b'"}'
    with pytest.raises(InvalidEnvelope, match="not UTF-8 at byte 31"):
        decode_envelope(raw, max_bytes=1 << 20, reply_prefix="reach:reply:")


@pytest.mark.parametrize(
    "fields", [{"capability": "text.echo\n"}, {"capability": "text.echo", "id": "abc\n"}]
)
def test_a_trailing_newline_does_not_slip_through_the_patterns(fields: dict[str, str]) -> None:
    with pytest.raises(InvalidEnvelope):
        decode_envelope(msgspec.json.encode(fields), max_bytes=1 << 20, reply_prefix="r:")


@pytest.mark.parametrize("session", ["", "a b", "x{y}", "tab\there"])
def test_session_ids_that_would_break_hash_tags_are_rejected(session: str) -> None:
    raw = msgspec.json.encode({"capability": "a.b", "session_id": session})
    with pytest.raises(InvalidEnvelope, match="session_id"):
        decode_envelope(raw, max_bytes=1 << 20, reply_prefix="r:")


def test_budget_is_read_as_budget_per_task_and_intent_may_stand_in_for_capability() -> None:
    old = decode(b'{"capability": "a.b", "budget": 2.5}', max_bytes=1024)
    assert (old.budget_per_task, old.budget) == (2.5, None)
    with pytest.raises(InvalidEnvelope, match="older name of budget_per_task"):
        decode(b'{"capability": "a.b", "budget": 1, "budget_per_task": 2}', max_bytes=1024)
    by_intent = decode(b'{"intent": "refund my order", "tenant": "team-a"}', max_bytes=1024)
    assert (by_intent.capability, by_intent.intent, by_intent.tenant) == (
        "",
        "refund my order",
        "team-a",
    )
    with pytest.raises(InvalidEnvelope, match="capability \\(or an intent\\) is required"):
        decode(b'{"payload": 1}', max_bytes=1024)
    with pytest.raises(InvalidEnvelope, match="tenant"):
        decode(b'{"capability": "a.b", "tenant": "has space"}', max_bytes=1024)
    with pytest.raises(InvalidEnvelope, match="tenant"):  # "-" is no tenant in usage
        decode(b'{"capability": "a.b", "tenant": "-"}', max_bytes=1024)
    assert decode(b'{"capability": "a.b", "tenant": "-a"}', max_bytes=1024).tenant == "-a"


@given(
    st.binary(max_size=300) | st.builds(lambda v: json.dumps({"reply_to": v}).encode(), st.text())
)
def test_a_stored_reply_to_reads_from_any_bytes(raw: bytes) -> None:
    found = stored_reply_to(raw)
    assert isinstance(found, str)
    if found:
        assert json.loads(raw)["reply_to"] == found


def test_an_agent_always_gets_the_key() -> None:
    bare = complete(decode(envelope_bytes(id="order-5")), now_s=1.0)
    keyed = complete(decode(envelope_bytes(id="order-6", idempotency_key="k-6")), now_s=1.0)
    assert bare.idempotency_key is None and bare.for_agent().idempotency_key == "order-5"
    assert keyed.for_agent() is keyed
