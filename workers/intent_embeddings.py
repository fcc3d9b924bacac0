"""The semantic layer's embedding scorer: any OpenAI-compatible ``/v1/embeddings`` endpoint.

``embedding_url`` is either the endpoint itself (ending in ``/embeddings``) or the API's base
(``http://host:8080/v1``), to which ``/embeddings`` is added. One POST per batch of intents::

    {"model": embedding_model, "input": [intent, ..., capability text, ...]}

answered by ``{"data": [{"index": 0, "embedding": [0.1, ...]}, ...]}``. The capabilities'
vectors are asked once per profile text and kept; later batches send their intents only.
The answer is untrusted: anything but one finite vector of one shared length per input (at
most ``MAX_ANSWER_BYTES``) is a failure, and so is a refused connection, a non-2xx status, or
``embedding_timeout_s`` passing (the whole exchange, however slowly the bytes drip). The
caller falls back to the lexical scorer on any :class:`EmbeddingFailure`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import anyio
import httpx
import msgspec

from broker.intent import MAX_INTENT_CHARS, CapabilityProfile, cosine
from broker.redaction import url_without_password

MAX_ANSWER_BYTES = 32 * 1024 * 1024
MAX_DIMENSIONS = 16_384


class EmbeddingFailure(Exception):
    """The endpoint gave no usable vectors; the message says why."""


class _Item(msgspec.Struct):
    embedding: list[float]
    index: int | None = None


class _Answer(msgspec.Struct):
    data: list[_Item]


_decoder = msgspec.json.Decoder(_Answer)


def endpoint_url(url: str) -> str:
    """The POST target of ``embedding_url``: as given when it ends in ``/embeddings``, else
    the base with ``/embeddings`` added."""
    base = url.rstrip("/")
    return base if base.endswith("/embeddings") else f"{base}/embeddings"


def vectors_of(body: bytes, count: int) -> list[list[float]]:
    """``count`` vectors from an answer's bytes, in input order; :class:`EmbeddingFailure`
    saying why for anything else."""
    try:
        answer = _decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise EmbeddingFailure(f"answer is not an embeddings list: {exc}") from exc
    if len(answer.data) != count:
        raise EmbeddingFailure(f"{len(answer.data)} vectors for {count} inputs")
    indexes = [item.index for item in answer.data]
    if all(i is not None for i in indexes):
        if sorted(i for i in indexes if i is not None) != list(range(count)):
            raise EmbeddingFailure("the answer's indexes are not 0..n-1")
        ordered = sorted(answer.data, key=lambda item: item.index or 0)
    else:
        ordered = answer.data
    vectors = [item.embedding for item in ordered]
    size = len(vectors[0]) if vectors else 0
    if not 0 < size <= MAX_DIMENSIONS or any(len(v) != size for v in vectors):
        raise EmbeddingFailure("vectors of no length, too long, or of different lengths")
    if not all(math.isfinite(x) for v in vectors for x in v):
        raise EmbeddingFailure("a vector holds a number that is not finite")
    return vectors


class EmbeddingScorer:
    """Similarities by embeddings; capability vectors kept for one snapshot at a time."""

    def __init__(self, url: str, model: str, timeout_s: float) -> None:
        self.url = endpoint_url(url)
        self.where = url_without_password(self.url)  # for messages and logs
        self.model = model
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
        self._vectors: dict[str, list[float]] = {}  # profile text -> its vector

    async def aclose(self) -> None:
        await self._client.aclose()

    async def similarities(
        self, intents: Sequence[str], profiles: Sequence[CapabilityProfile]
    ) -> list[dict[str, float]]:
        """Per intent, capability → cosine similarity (0..1). A profile's vector is asked
        once, and kept while some capability has that very text."""
        current = {p.text for p in profiles}
        self._vectors = {t: v for t, v in self._vectors.items() if t in current}
        missing = list(dict.fromkeys(p.text for p in profiles if p.text not in self._vectors))
        texts = [i[:MAX_INTENT_CHARS] for i in intents] + missing
        vectors = await self._embed(texts) if texts else []
        for text, vector in zip(missing, vectors[len(intents) :], strict=True):
            self._vectors[text] = vector
        return [
            {p.capability: cosine(vector, self._vectors[p.text]) for p in profiles}
            for vector in vectors[: len(intents)]
        ]

    async def _embed(self, texts: list[str]) -> list[list[float]]:
        body = msgspec.json.encode({"model": self.model, "input": texts})
        headers = {"content-type": "application/json"}
        try:
            with anyio.fail_after(self.timeout_s):
                async with self._client.stream(
                    "POST", self.url, content=body, headers=headers
                ) as response:
                    if not response.is_success:
                        raise EmbeddingFailure(f"{self.where} answered {response.status_code}")
                    answer = bytearray()
                    async for chunk in response.aiter_bytes():
                        answer += chunk
                        if len(answer) > MAX_ANSWER_BYTES:
                            raise EmbeddingFailure(f"answer over {MAX_ANSWER_BYTES} bytes")
        except TimeoutError as exc:
            raise EmbeddingFailure(f"no answer from {self.where} in {self.timeout_s}s") from exc
        except httpx.HTTPError as exc:
            raise EmbeddingFailure(f"{self.where}: {type(exc).__name__}: {exc}") from exc
        return vectors_of(bytes(answer), len(texts))
