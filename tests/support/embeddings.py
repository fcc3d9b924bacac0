"""A real OpenAI-compatible ``/v1/embeddings`` server on loopback for tests, with deterministic
vectors: each word counts on its concept's dimension (a toy thesaurus: "money back" and
"reimbursed" are one concept), any other word on a dimension of its own hash, at a third of
the weight. Paraphrases the lexical scorer cannot see are near here, and nothing is random."""

from __future__ import annotations

import re
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapters.asgi import serve_app

CONCEPTS = {
    "refund": 0, "refunds": 0, "reimburse": 0, "reimbursed": 0, "money": 0, "back": 0,
    "payment": 0, "repay": 0, "repaid": 0, "compensation": 0,
    "weather": 1, "forecast": 1, "rain": 1, "sunny": 1, "umbrella": 1, "temperature": 1,
    "today": 2, "tomorrow": 2,
}  # fmt: skip
IGNORED = {"i", "my", "a", "the", "or", "and", "for", "of", "to", "can", "get", "want", "s"}
DIMENSIONS = 64


def embed(text: str) -> list[float]:
    vector = [0.0] * DIMENSIONS
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in IGNORED:
            continue
        if word in CONCEPTS:
            vector[CONCEPTS[word]] += 1.0
        else:
            vector[3 + zlib.crc32(word.encode()) % (DIMENSIONS - 3)] += 1 / 3
    return vector


@dataclass
class EmbeddingsLog:
    requests: list[dict[str, object]] = field(default_factory=list)


@dataclass
class RunningEmbeddings:
    url: str  # the API's base, ending in /v1
    log: EmbeddingsLog


def _app(log: EmbeddingsLog) -> Starlette:
    async def embeddings(request: Request) -> Response:
        body = await request.json()
        log.requests.append(body)
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": embed(t)} for i, t in enumerate(texts)
        ]
        return JSONResponse({"object": "list", "data": data, "model": body.get("model")})

    return Starlette(routes=[Route("/v1/embeddings", embeddings, methods=["POST"])])


@asynccontextmanager
async def embeddings_server() -> AsyncIterator[RunningEmbeddings]:
    log = EmbeddingsLog()
    async with serve_app(_app(log)) as url:
        yield RunningEmbeddings(f"{url.rstrip('/')}/v1", log)
