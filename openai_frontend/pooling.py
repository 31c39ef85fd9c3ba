"""Embeddings, scores and reranking, the pure part: what each `llm` pooling request holds
(vllm_backend's `embedding_request` JSON, docs/INTERFACE.md), and the OpenAI / vLLM
response bodies built from the vectors it answers.

A cross-encoder scores a pair itself (the `llm` model takes [text_1, text_2] as its
input); an embedder's score is the cosine of the two embeddings, as vLLM computes it."""
from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any

from openai_frontend.errors import bad_request

# A text, token ids, or a cross-encoder's (text_1, text_2) pair.
PoolingInput = str | list[int] | list[str]

_FORMS = ("input must be a string, a list of strings, a list of token ids or a list of "
          "lists of token ids")


def split_inputs(value: Any) -> list[str | list[int]]:
    """/v1/embeddings' `input` in OpenAI's four forms -> one input per `llm` request."""
    def is_id(item: Any) -> bool:
        return isinstance(item, int) and not isinstance(item, bool) and item >= 0

    if isinstance(value, str):
        inputs: list[str | list[int]] = [value]
    elif not isinstance(value, list) or not value:
        got = "an empty list" if value == [] else type(value).__name__
        raise bad_request(f"{_FORMS}; got {got}", "input")
    elif all(isinstance(item, str) for item in value):
        inputs = list(value)
    elif all(is_id(item) for item in value):
        inputs = [list(value)]
    elif all(isinstance(item, list) and item and all(is_id(t) for t in item) for item in value):
        inputs = [list(item) for item in value]
    else:
        raise bad_request(f"{_FORMS} (token ids non-negative integers), not a mix of them",
                          "input")
    for i, item in enumerate(inputs):
        if not item:
            raise bad_request(f"input[{i}] must not be empty" if len(inputs) > 1
                              else "input must not be empty", "input")
    return inputs


def pooling_payload(item: PoolingInput, *, dimensions: int | None = None,
                    truncate_prompt_tokens: int | None = None,
                    use_activation: bool | None = None) -> dict[str, Any]:
    """One `embedding_request`: only what the client set goes in pooling_params."""
    params = {name: value for name, value in (("dimensions", dimensions),
                                              ("truncate_prompt_tokens", truncate_prompt_tokens),
                                              ("use_activation", use_activation))
              if value is not None}
    return {"input": item, "pooling_params": params}


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """"base64": the little-endian float32 bytes, base64 text (OpenAI's and vLLM's)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def decode_embedding(text: str) -> list[float]:
    """encode_embedding's inverse, as a client reads "base64" (numpy's frombuffer float32)."""
    raw = base64.b64decode(text)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def _usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def embedding_body(model: str, vectors: list[list[float]], prompt_tokens: int,
                   encoding_format: str) -> dict[str, Any]:
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model,
            "data": [{"object": "embedding", "index": i,
                      "embedding": encode_embedding(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": _usage(prompt_tokens)}


def score_pairs(text_1: str | list[str], text_2: str | list[str],
                names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's rule: 1:1, 1:N (the one text_1 against each text_2) or N:N (pairwise).
    `names`: the two fields as the request spells them (errors name them)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first:
        raise bad_request(f"{names[0]} must hold at least one text", names[0])
    if not second:
        raise bad_request(f"{names[1]} must hold at least one text", names[1])
    if len(first) != 1 and len(first) != len(second):
        raise bad_request(f"{names[0]} and {names[1]} must be 1:1, 1:N or N:N; got "
                          f"{len(first)}:{len(second)}", names[1])
    for name, texts in zip(names, (first, second)):
        if not all(texts):
            raise bad_request(f"{name} must not hold an empty text", name)
    return [(first[0] if len(first) == 1 else first[i], text) for i, text in enumerate(second)]


def cosine(a: list[float], b: list[float]) -> float:
    """torch's cosine_similarity: the norms' product clamped at 1e-8."""
    if len(a) != len(b):
        raise ValueError(f"vectors of {len(a)} and {len(b)} values")
    dot = sum(x * y for x, y in zip(a, b))
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / max(norms, 1e-8)


def score_body(model: str, scores: list[float], prompt_tokens: int) -> dict[str, Any]:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": _usage(prompt_tokens)}


def rerank_body(model: str, documents: list[str], scores: list[float], top_n: int,
                prompt_tokens: int) -> dict[str, Any]:
    """Highest score first (ties keep the documents' order); top_n 0: all of them."""
    results = [{"index": i, "document": {"text": doc}, "relevance_score": s}
               for i, (doc, s) in enumerate(zip(documents, scores))]
    results.sort(key=lambda r: r["relevance_score"], reverse=True)
    if 0 < top_n < len(results):
        results = results[:top_n]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": _usage(prompt_tokens),
            "results": results}
