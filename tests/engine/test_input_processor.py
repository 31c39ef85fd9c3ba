"""engine/input_processor.py alone, with stand-ins for the tokenizer, LoRA manager and
grammar compiler: every refusal comes before anything is started or kept."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from engine.input_processor import InputProcessor
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams


class Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text]

    def decode(self, token_ids: list[int], **_) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


class Grammars:
    def __init__(self) -> None:
        self.started = 0

    def compile_async(self, spec) -> Future:
        self.started += 1
        return Future()


class Loras:
    def __init__(self) -> None:
        self.loaded: list[str] = []

    def adapter(self, request: LoRARequest) -> None:
        self.loaded.append(request.lora_name)


def processor(lora=None, taken=(), max_prompt=100) -> tuple[InputProcessor, Grammars]:
    grammars = Grammars()

    def admissible(rid: str, num_tokens: int) -> None:
        if num_tokens > max_prompt:
            raise ValueError(f"prompt of {num_tokens} tokens is longer than max_model_len")

    return InputProcessor(Tokenizer(), 50, (2,), 128, 5, lora, grammars,
                          is_taken=set(taken).__contains__, check_admissible=admissible), grammars


JSON = {"structured_outputs": {"json": {"type": "object"}}}


def test_a_request_becomes_one_sequence_per_n_sharing_one_compile():
    proc, grammars = processor()
    req = proc.process("r", "hello", SamplingParams(n=3, max_tokens=None, seed=1, **JSON))
    assert len({s.request_id for s in req.sequences}) == 3
    assert all(s.prompt_token_ids == req.token_ids for s in req.sequences)
    assert all(s.max_tokens == 128 - len(req.token_ids) for s in req.sequences)  # max_model_len
    assert req.prompt_text == "hello" and grammars.started == 1 and req.grammar is not None
    plain = proc.process("ids", [1, 2, 3], None)
    assert plain.prompt_text is None and plain.grammar is None and len(plain.sequences) == 1


@pytest.mark.parametrize("prompt, params, kwargs, message", [
    ([1, 50], SamplingParams(**JSON), {}, "out of vocabulary"),
    ([1], SamplingParams(stop_token_ids=[99], **JSON), {}, "stop_token_ids"),
    ([1], SamplingParams(logprobs=6, **JSON), {}, "max_logprobs"),
    ([1] * 101, SamplingParams(**JSON), {}, "max_model_len"),
    ([1], SamplingParams(**JSON), {"lora_request": LoRARequest("a", 1, "/nowhere")}, "enable_lora"),
    ([1], SamplingParams(**JSON), {"request_id": "taken"}, "already in use"),
])
def test_a_refused_request_starts_no_compile(prompt, params, kwargs, message):
    proc, grammars = processor(taken={"taken"})
    request_id = kwargs.pop("request_id", "r")
    with pytest.raises(ValueError, match=message):
        proc.process(request_id, prompt, params, **kwargs)
    assert grammars.started == 0


def test_an_adapter_is_loaded_before_the_request_is_built():
    loras = Loras()
    proc, _ = processor(lora=loras)
    req = proc.process("r", [1, 2], None, lora_request=LoRARequest("style", 1, "/adapters/style"))
    assert loras.loaded == ["style"] and req.sequences[0].lora_request.lora_name == "style"
