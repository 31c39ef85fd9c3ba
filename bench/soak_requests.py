"""What the soak bench sends: greedy requests of mixed lengths, every kind of bad request,
and the in-process engine whose outputs the served ones must equal."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.soak_client import llm_tensors

STARTERS = ["Hello, my name is", "The capital of France is", "Écrire un poème sur la mer:",
            "def fibonacci(n):", "日本の首都は", "1, 2, 3, 4,", "Once upon a time", "Q: 2+2=? A:"]
WORDS = ["river", "stone", "quiet", "lamp", "seven", "orbit", "maple", "signal", "copper", "drift"]


@dataclass(frozen=True, slots=True)
class GoodRequest:
    prompt: str
    sampling_json: str  # canonical JSON: also the reference's cache key

    @property
    def sampling(self) -> dict[str, Any]:
        return json.loads(self.sampling_json)

    def tensors(self) -> dict[str, np.ndarray]:
        return llm_tensors(self.prompt, self.sampling_json)


def greedy_request(prompt: str, max_tokens: int, forced: bool = False, **extra: Any) -> GoodRequest:
    sampling = {"temperature": 0, "max_tokens": max_tokens, **extra}
    if forced:  # exactly max_tokens, so its duration is known
        sampling["min_tokens"] = max_tokens
    return GoodRequest(prompt, json.dumps(sampling, sort_keys=True))


def mixed_requests(count: int, rng: random.Random, max_new: int = 64) -> list[GoodRequest]:
    """Prompts of 4 to ~50 tokens, 1 to max_new new tokens."""
    out = []
    for _ in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))
        prompt = f"{rng.choice(STARTERS)} {words}".rstrip()
        out.append(greedy_request(prompt, rng.randint(1, max_new)))
    return out


@dataclass(frozen=True, slots=True)
class BadRequest:
    kind: str
    tensors: dict[str, np.ndarray]
    fragment: str  # must appear in the error message


def bad_requests(max_model_len: int) -> list[BadRequest]:
    """One of each kind; sampling given as raw JSON text where Python's json cannot write it."""
    many_stops = json.dumps({"max_tokens": 4, "stop": [f"s{i}" for i in range(257)]})
    long_stop = json.dumps({"max_tokens": 4, "stop": ["x" * 1025]})
    stops_over_total = json.dumps({"max_tokens": 4, "stop": ["y" * 1000] * 17})
    many_stop_ids = json.dumps({"max_tokens": 4, "stop_token_ids": list(range(3, 260))})
    over_len = "hello " * (max_model_len + 100)
    cases = [
        ("unparseable JSON", "{max_tokens: 3", "JSON"),
        ("JSON not an object", "[1, 2]", "JSON object"),
        ("unknown key", '{"max_tokenz": 3}', "max_tokenz"),
        ("negative temperature", '{"temperature": -1}', "temperature"),
        ("top_p above 1", '{"top_p": 1.5}', "top_p"),
        ("negative top_k", '{"top_k": -5}', "top_k"),
        ("max_tokens 0", '{"max_tokens": 0}', "max_tokens"),
        ("non-numeric max_tokens", '{"max_tokens": "many"}', "max_tokens"),
        ("min_tokens above max", '{"max_tokens": 2, "min_tokens": 5}', "min_tokens"),
        ("logprobs 21", '{"max_tokens": 2, "logprobs": 21}', "logprobs"),
        ("bad boolean", '{"ignore_eos": "maybe"}', "ignore_eos"),
        ("stop not a list", '{"stop": 7}', "stop"),
        ("NaN seed", '{"seed": NaN}', "seed"),
        ("Infinity seed", '{"seed": Infinity}', "seed"),
        ("huge-int seed", '{"seed": 1' + "0" * 30 + "}", "seed"),
        ("seed 2**64", '{"seed": 18446744073709551616}', "seed"),
        ("NaN temperature", '{"temperature": NaN}', "temperature"),
        ("Infinity repetition_penalty", '{"repetition_penalty": Infinity}', "repetition_penalty"),
        ("257 stop strings", many_stops, "stop"),
        ("1025-char stop string", long_stop, "stop"),
        ("stop strings over 16384 chars", stops_over_total, "stop"),
        ("257 stop_token_ids", many_stop_ids, "stop_token_ids"),
        ("stop_token_id outside vocab", '{"stop_token_ids": [1000000]}', "stop_token_ids"),
        ("huge priority", '{"priority": 1099511627776}', "priority"),
    ]
    out = [BadRequest(kind, llm_tensors("hi", raw), fragment) for kind, raw, fragment in cases]
    out += [
        BadRequest("prompt over max_model_len", llm_tensors(over_len, '{"max_tokens": 2}'), "max_model_len"),
        BadRequest("8 MB text_input", llm_tensors("hello " * 1_400_000, '{"max_tokens": 2}'), "bytes"),
        BadRequest("empty prompt", llm_tensors("", '{"max_tokens": 2}'), "empty"),
        BadRequest("stream without exclude_input_in_output",
                   llm_tensors("hi", '{"max_tokens": 2}', exclude_input_in_output=False),
                   "exclude_input_in_output"),
        BadRequest("text_input not BYTES", {"text_input": np.array([7], dtype=np.int32)}, "text_input"),
    ]
    return out


class Reference:
    """Greedy outputs of the in-process engine, computed in one batch per call and cached;
    one engine per max_model_len (the probe model's is longer)."""

    def __init__(self, model_path: str | None, engine_args: dict[str, str]) -> None:
        self._model_path = model_path
        self._engine_args = engine_args
        self._engines: dict[int, Any] = {}
        self._texts: dict[tuple[int, GoodRequest], str] = {}

    def texts(self, requests: list[GoodRequest], max_model_len: int | None = None) -> list[str]:
        from engine import LLM, SamplingParams

        length = max_model_len or int(self._engine_args["max_model_len"])
        missing = list(dict.fromkeys(r for r in requests if (length, r) not in self._texts))
        if missing:
            if length not in self._engines:
                self._engines[length] = LLM(model=self._model_path,
                                            **{**self._engine_args, "max_model_len": str(length)})
            params = [SamplingParams(**r.sampling) for r in missing]
            engine = self._engines[length]
            outputs = engine.generate([r.prompt for r in missing], params, use_tqdm=False)
            # The soak streams every request, and a stream is not cleaned up as a whole
            # text is (as vLLM's): the reference is its tokens decoded without cleanup.
            tokenizer = engine.llm_engine.tokenizer
            self._texts.update(((length, r), tokenizer.decode(
                o.outputs[0].token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
                for r, o in zip(missing, outputs))
        return [self._texts[(length, r)] for r in requests]
