"""A stand-in for the engine's scheduler around engine/output/output_processor.py: real
Requests with the real detokenizer and stop checker, scripted tokens (one, or several as
speculative decoding gives) per running sequence per step, so output handling is tested
without a model."""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.request import Request
from engine.core.stop_checker import check_stop
from engine.output.detokenizer import IncrementalDetokenizer
from engine.output.output_processor import OutputProcessor
from engine.output.parallel_sampling import fan_out
from engine.outputs import Logprob
from engine.sampling_params import SamplingParams

EOS = 2  # the SmolLM2 tokenizer's
TOP = 0  # the top-1 alternative the driver reports with every token (never in a script)


@dataclass(slots=True)
class _Logprobs:  # the runner's TokenLogprobs
    sampled: float
    top: dict[int, float]
    rank: int


def scripted_logprobs(token_ids: list[int]) -> list[dict[int, Logprob]]:
    """What the driver samples with each token: its own logprob first (ranked 2nd), then
    a top-1."""
    return [{t: Logprob(-0.001 * t, 2), TOP: Logprob(-9.0, 1)} for t in token_ids]


class Driver:
    """Adds requests as LLMEngine.add_request does and steps them as the scheduler does:
    one scripted token per running sequence, the stop checker deciding the end."""

    def __init__(self, tokenizer, stream_interval: int = 1, tokens_per_step: int = 1) -> None:
        """`tokens_per_step` > 1: a step gives each sequence up to that many tokens, as a
        step that accepts speculative drafts does (the runner's logprobs cover them all,
        a stop drops the rest)."""
        self.tokenizer = tokenizer
        self.tokens_per_step = tokens_per_step
        self.processor = OutputProcessor(stream_interval)
        self.running: list[Request] = []
        self.scripts: dict[str, list[int]] = {}
        self.steps = 0

    def add(self, request_id: str, params: SamplingParams, scripts: list[list[int]],
            prompt: list[int] | None = None) -> list[Request]:
        """`scripts`: each sequence's tokens (fan_out's order); it ends by the stop checker,
        at the end of its script when params.max_tokens is None."""
        prompt = prompt or self.tokenizer.encode("User: say something.\nAssistant:")
        requests = [Request(rid, prompt, p, eos_token_id=EOS,
                            detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, p))
                    for rid, p in fan_out(request_id, params)]
        for request, script in zip(requests, scripts, strict=True):
            request.max_tokens = params.max_tokens or len(script)
            self.scripts[request.request_id] = script
        self.processor.add_request(request_id, None, prompt, params, requests)
        self.running += requests
        return requests

    def step(self):
        self.steps += 1
        updated, logprobs = [], {}
        for request in list(self.running):
            script = self.scripts[request.request_id]
            done = request.num_output_tokens
            tokens = script[done:done + self.tokens_per_step]
            logprobs[request.request_id] = [_Logprobs(-0.001 * t, {TOP: -9.0}, 2) for t in tokens]
            for token in tokens:
                request.all_token_ids.append(token)
                stop = check_stop(request, token, max_model_len=4096)
                if stop is not None:
                    request.status, request.stop_reason = stop.status, stop.stop_reason
                    request.finished_on_stop_token = stop.on_stop_token
                    self.running.remove(request)
                    break
            updated.append(request)
        return self.processor.process(updated, logprobs)

    def run(self) -> list[tuple[int, object]]:
        outs = []
        while self.running:
            outs += [(self.steps, out) for out in self.step()]
        return outs
