"""LLM.embed and LLM.score (vLLM's offline pooling API) over an engine started with
runner="pooling": the requests go in together and the outputs come back in input order.
score: a cross-encoder (classify task, one label) scores each (text_1, text_2) pair as
one prompt; an embedder scores by the cosine of the two texts' embeddings (vLLM's
bi-encoder path)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from engine.offline_run import run_to_completion
from engine.pooling.outputs import (EmbeddingRequestOutput, PoolingRequestOutput,
                                    ScoringOutput, ScoringRequestOutput)
from engine.pooling.params import PoolingParams


def check_pooling(engine: Any, method: str) -> Any:
    """The engine's PoolingEngine; ValueError naming `runner` when it generates."""
    if engine.pooling is None:
        raise ValueError(f"LLM.{method}() needs runner='pooling'; this LLM runs "
                         "runner='generate' (start it with LLM(model, runner='pooling'))")
    return engine.pooling


def embed(engine: Any, new_id: Callable[[], str], prompts, pooling_params, use_tqdm,
          tokenization_kwargs: dict | None) -> list[EmbeddingRequestOutput]:
    pooling = check_pooling(engine, "embed")
    if pooling.task != "embed":
        raise ValueError(f"LLM.embed(): this model's task is {pooling.task!r} (a "
                         "cross-encoder); LLM.score() scores text pairs with it")
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    outputs = run(engine, new_id, list(prompts), pooling_params, use_tqdm,
                  tokenization_kwargs, "embed")
    return [EmbeddingRequestOutput.from_base(o) for o in outputs]


def score(engine: Any, new_id: Callable[[], str], data_1, data_2, pooling_params, use_tqdm,
          tokenization_kwargs: dict | None) -> list[ScoringRequestOutput]:
    pooling = check_pooling(engine, "score")
    if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
        raise ValueError(f"LLM.score() takes one PoolingParams, got {type(pooling_params).__name__}")
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if not all(isinstance(t, str) for t in left + right):
        raise ValueError("LLM.score() scores texts: data_1 and data_2 are strings or lists "
                         "of strings")
    if len(left) == 1:
        left = left * len(right)
    if len(left) != len(right) or not right:
        raise ValueError(f"LLM.score(): data_1 has {len(left)} texts and data_2 "
                         f"{len(right)}; pass 1 -> N or N -> N")
    if pooling.task == "classify":
        num_labels = getattr(engine.loaded.hf_config, "num_labels", 0)
        if num_labels != 1:
            raise ValueError(f"LLM.score(): a cross-encoder's score is its one label; this "
                             f"model has num_labels={num_labels}")
        outputs = run(engine, new_id, list(zip(left, right)), pooling_params, use_tqdm,
                      tokenization_kwargs, "score")
        return [ScoringRequestOutput.from_base(o) for o in outputs]
    embedded = run(engine, new_id, left + right, pooling_params, use_tqdm,
                   tokenization_kwargs, "score")
    pad = getattr(engine.tokenizer, "pad_token_id", None)
    return [_cosine_output(a, b, pad) for a, b in zip(embedded[:len(left)],
                                                        embedded[len(left):])]


def _cosine_output(a: PoolingRequestOutput, b: PoolingRequestOutput,
                   pad: int | None) -> ScoringRequestOutput:
    x, y = a.outputs.data, b.outputs.data
    norms = math.sqrt(sum(v * v for v in x)) * math.sqrt(sum(v * v for v in y))
    value = sum(p * q for p, q in zip(x, y)) / max(norms, 1e-8)
    return ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(value),
                                a.prompt_token_ids + ([pad] if pad is not None else [])
                                + b.prompt_token_ids,
                                a.num_cached_tokens + b.num_cached_tokens, True)


def run(engine: Any, new_id: Callable[[], str], prompts: list, pooling_params, use_tqdm,
        tokenization_kwargs: dict | None, desc: str) -> list[PoolingRequestOutput]:
    """Add every prompt, step until all are done; outputs in input order. A prompt the
    engine refuses fails the call naming its index, and nothing of it stays queued."""
    if not prompts:
        raise ValueError("pass at least one prompt")
    params = _params_per_prompt(pooling_params, len(prompts), tokenization_kwargs)

    def adder(index: int, prompt, p) -> Callable[[], str]:
        def add() -> str:
            rid = new_id()
            try:
                engine.add_request(rid, prompt, p)
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from exc
            return rid
        return add

    return run_to_completion(engine, map(adder, range(len(prompts)), prompts, params), desc,
                             use_tqdm)


def _params_per_prompt(pooling_params, count: int,
                       tokenization_kwargs: dict | None) -> list[PoolingParams | None]:
    if pooling_params is None or not isinstance(pooling_params, Sequence):
        params = [pooling_params] * count
    else:
        params = list(pooling_params)
        if len(params) != count:
            raise ValueError(f"got {len(params)} pooling_params for {count} prompts")
    if not tokenization_kwargs:
        return params
    # vLLM 0.32 takes truncate_prompt_tokens here; nothing else of HF's tokenizer
    # keywords is honoured, so nothing else is accepted.
    unknown = sorted(set(tokenization_kwargs) - {"truncate_prompt_tokens"})
    if unknown:
        raise ValueError(f"tokenization_kwargs {unknown} are not supported (only "
                         "truncate_prompt_tokens)")
    k = tokenization_kwargs["truncate_prompt_tokens"]
    return [dataclasses.replace(p if isinstance(p, PoolingParams) else PoolingParams(),
                                truncate_prompt_tokens=k)
            if p is None or isinstance(p, PoolingParams) else p for p in params]
