"""The intent router's edges: the embeddings answer (untrusted), the endpoint URL, the card's
words from the sidecar's options, and the ``feedback`` command's arguments."""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from adapters.factory import SidecarOptionError, make_card
from broker.records import MAX_EXAMPLES, InstanceState
from broker.registry import card_fields, view_from_hash
from workers.cli import main
from workers.intent_embeddings import EmbeddingFailure, endpoint_url, vectors_of


def answer(*vectors: object, indexed: bool = True) -> bytes:
    data = [{"embedding": v, **({"index": i} if indexed else {})} for i, v in enumerate(vectors)]
    return msgspec.json.encode({"object": "list", "data": data, "model": "m"})


def test_the_endpoint_is_the_url_or_the_base_with_embeddings_added() -> None:
    assert endpoint_url("http://h:1/v1") == "http://h:1/v1/embeddings"
    assert endpoint_url("http://h:1/v1/") == "http://h:1/v1/embeddings"
    assert endpoint_url("http://h:1/v1/embeddings") == "http://h:1/v1/embeddings"


def test_vectors_come_back_in_input_order() -> None:
    body = msgspec.json.encode(
        {"data": [{"index": 1, "embedding": [0.0, 1.0]}, {"index": 0, "embedding": [1.0, 0.0]}]}
    )
    assert vectors_of(body, 2) == [[1.0, 0.0], [0.0, 1.0]]
    assert vectors_of(answer([1.0], [2.0], indexed=False), 2) == [[1.0], [2.0]]


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[]",
        b'{"data": "x"}',
        answer([1.0]),  # one vector for two inputs
        answer([1.0], [1.0, 2.0]),  # different lengths
        answer([], []),  # empty vectors
        answer(["a"], [1.0]),
        b'{"data": [{"index": 0, "embedding": [1e999]}, {"index": 1, "embedding": [1]}]}',
        b'{"data": [{"index": 0, "embedding": [1]}, {"index": 0, "embedding": [1]}]}',
        b"[" * 100_000,
    ],
)
def test_a_malformed_answer_is_a_failure_not_a_crash(body: bytes) -> None:
    with pytest.raises(EmbeddingFailure):
        vectors_of(body, 2)


@given(st.binary(max_size=200))
def test_any_bytes_are_vectors_or_a_failure(body: bytes) -> None:
    try:
        vectors_of(body, 1)
    except EmbeddingFailure:
        pass


def test_the_cards_words_go_on_the_card_and_come_back_from_its_hash() -> None:
    card = make_card(
        agent_id="pay",
        capabilities=["payment.refund"],
        endpoint="http://x",
        max_inflight=1,
        description="Refunds payments",
        examples=["refund order 1", "money back"],
    )
    fields = card_fields(card, credits=1, state=InstanceState.UP, hb_ms=1)
    raw = {
        k.encode(): str(v).encode() if not isinstance(v, bytes) else v for k, v in fields.items()
    }
    view = view_from_hash(raw, 0)
    assert view.card.description == "Refunds payments"
    assert view.card.examples == ("refund order 1", "money back")


def test_too_many_words_are_refused_by_option() -> None:
    with pytest.raises(SidecarOptionError, match="--example"):
        make_card(
            agent_id="a",
            capabilities=["a.b"],
            endpoint="",
            max_inflight=1,
            examples=["x"] * (MAX_EXAMPLES + 1),
        )
    with pytest.raises(SidecarOptionError, match="--describe"):
        make_card(
            agent_id="a", capabilities=["a.b"], endpoint="", max_inflight=1, description="x" * 5000
        )


def test_feedback_needs_good_or_bad() -> None:
    result = CliRunner().invoke(main, ["feedback", "some-id"])
    assert result.exit_code == 2 and "--good" in result.output
