"""Structured outputs through the in-process engine on a tiny random-weight Llama: its free
text is garbage, so every output that parses and validates shows the grammar at work."""
from __future__ import annotations

import enum
import json
import re
import sys
from concurrent.futures import Future
from typing import Annotated

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from engine import LLM, SamplingParams
from engine.llm_engine import EngineStepError
from engine.core.request import Request
from engine.sample.sampler import Sampler
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.grammar import GrammarCompiler, RequestGrammar
from testing.tiny_model import make_tiny_model_dir

pytestmark = pytest.mark.timeout(600)

PROMPTS = ["The quick brown fox", "1, 2, 3,", "Paris is the capital of", "def main():"]
Short = Annotated[str, Field(max_length=10)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Address(Strict):
    city: Short
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class Person(Strict):
    name: Short
    address: Address


class Colour(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "light blue"


class Paint(Strict):
    colour: Colour
    coats: Annotated[int, Field(ge=1, le=3)]


class Reading(Strict):
    celsius: Annotated[int, Field(ge=-40, le=125)]
    ok: bool


SCHEMAS = {
    "nested_object": TypeAdapter(Person),
    "array": TypeAdapter(Annotated[list[Short], Field(min_length=1, max_length=4)]),
    "enum": TypeAdapter(Paint),
    "integer_range": TypeAdapter(Reading),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3))


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", num_kv_blocks=256, block_size=16)


def texts(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def constrained(so, **kwargs):
    return SamplingParams(max_tokens=kwargs.pop("max_tokens", 400), structured_outputs=so, **kwargs)


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_json_output_parses_and_validates_greedy_and_sampled(llm, name):
    adapter = SCHEMAS[name]
    so = {"json": adapter.json_schema()}
    params = [constrained(so, temperature=0)] + [
        constrained(so, temperature=1.0, top_p=0.95, seed=seed) for seed in range(len(PROMPTS) - 1)]
    outputs = texts(llm, PROMPTS, params) + texts(llm, PROMPTS[:2], [
        constrained(so, temperature=1.5, seed=7), constrained(so, temperature=0.8, seed=8)])
    for text, reason in outputs:
        assert reason == "stop", text
        json.loads(text)
        adapter.validate_json(text, strict=True)
    # Sampling really varied the outputs; the schema held them all.
    assert len({t for t, _ in outputs}) > 2


def test_json_schema_as_text_and_compact_whitespace(llm):
    schema = json.dumps(SCHEMAS["enum"].json_schema())
    for text, reason in texts(llm, PROMPTS, [constrained(
            {"json": schema, "disable_any_whitespace": True}, temperature=1.0, seed=s)
            for s in range(len(PROMPTS))]):
        assert reason == "stop"
        SCHEMAS["enum"].validate_json(text, strict=True)
        # Without free whitespace the output is json.dumps' own layout.
        assert text == json.dumps(json.loads(text))


def test_json_object_gives_json(llm):
    for text, reason in texts(llm, PROMPTS, [constrained({"json_object": True}, temperature=0.7,
                                                         seed=s, max_tokens=600)
                                             for s in range(len(PROMPTS))]):
        if reason == "stop":  # free-form strings may run to max_tokens
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


def test_regex_choice_and_grammar_outputs_match(llm):
    regex = r"[a-z]{2,5}-[0-9]{2,4}(\.[0-9])?"
    choices = ["yes", "no", 'say "maybe"\nthen']
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x" item'
    seeds = range(6)
    for text, reason in texts(llm, ["Code:"] * 6, [constrained({"regex": regex}, temperature=1.0, seed=s)
                                                   for s in seeds]):
        assert reason == "stop" and re.fullmatch(regex, text), text
    picked = texts(llm, ["Answer:"] * 6, [constrained({"choice": choices}, temperature=1.0, seed=s)
                                          for s in seeds])
    assert all(reason == "stop" and text in choices for text, reason in picked)
    assert len({t for t, _ in picked}) > 1
    item = r"x*[0-9]"
    for text, reason in texts(llm, ["List:"] * 3, [constrained({"grammar": grammar}, temperature=1.0,
                                                               seed=s) for s in range(3)]):
        assert reason == "stop" and re.fullmatch(rf"\({item}(,{item})*\)", text), text


def test_grammar_end_stops_despite_ignore_eos_and_min_tokens(llm):
    (text, reason), = texts(llm, ["Pick:"], [constrained(
        {"choice": ["alpha", "beta"]}, temperature=0, ignore_eos=True, min_tokens=20)])
    assert reason == "stop" and text in ("alpha", "beta")


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, top_k=50, seed=11, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)]
    alone = llm.generate(PROMPTS[:3], free, use_tqdm=False)
    so = {"json": SCHEMAS["nested_object"].json_schema()}
    mixed_params = [free[0], constrained(so, temperature=0), free[1],
                    constrained(so, temperature=1.0, seed=5), free[2]]
    mixed = llm.generate([PROMPTS[0], PROMPTS[3], PROMPTS[1], PROMPTS[3], PROMPTS[2]], mixed_params,
                         use_tqdm=False)
    for before, after in zip(alone, [mixed[0], mixed[2], mixed[4]]):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids
    for got, want in zip(mixed[4].outputs[0].logprobs, alone[2].outputs[0].logprobs, strict=True):
        assert got.keys() == want.keys()
        assert [lp.logprob for lp in got.values()] == pytest.approx(
            [lp.logprob for lp in want.values()], abs=1e-5)
    for out in (mixed[1], mixed[3]):
        SCHEMAS["nested_object"].validate_json(out.outputs[0].text, strict=True)


def test_preemption_and_chunked_prefill_keep_the_grammar_position(tiny, llm):
    so = {"json": SCHEMAS["array"].json_schema()}
    prompts = [("You are a helpful assistant. " * 4) + p for p in PROMPTS] + PROMPTS
    params = [constrained(so, temperature=0) if i % 2 else
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for i in range(len(prompts))]
    plain = texts(llm, prompts, params)
    # 40 blocks hold one request of max_model_len: constrained requests join the scheduler
    # once their grammar compiled, a step or more after the others, and preemption must
    # follow whenever that is.
    stressed = LLM(tiny, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=160,
                   max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8)
    assert texts(stressed, prompts, params) == plain
    assert stressed.llm_engine.get_stats().num_preemptions_total > 0


def compile_at_once(engine, monkeypatch):
    """The engine's grammars compile on the caller's thread, so a constrained request
    joins the scheduler at the next step without fail (otherwise whenever its compile on
    the compiler's thread is done)."""
    compiler = engine.grammar_compiler

    def compile_now(params):
        future = Future()
        future.set_result(compiler.compile(params))
        return future

    monkeypatch.setattr(compiler, "compile_async", compile_now)


def test_a_failed_sampling_step_does_not_advance_the_grammars(llm, monkeypatch):
    """A row that breaks the sampler fails alone; the constrained rows of that step
    resample the same token next step, so their grammars must not have moved."""
    engine = llm.llm_engine
    compile_at_once(engine, monkeypatch)  # all three in the first step
    so = {"json": SCHEMAS["integer_range"].json_schema()}
    params = [constrained(so, temperature=0), constrained(so, temperature=1.0, seed=2)]
    # Token ids: the engine's own requests stream (their text is not cleaned up as a
    # FINAL_ONLY text is), the ids are the same either way.
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:2], params, use_tqdm=False)]
    broken = SamplingParams(temperature=1.0, max_tokens=8)
    broken.top_k = 0.5  # past validation: breaks inside the sampler
    for i, p in enumerate(params):
        engine.add_request(f"ok-{i}", PROMPTS[i], p)
    engine.add_request("broken", PROMPTS[2], broken)
    finals, failures = {}, []
    while engine.has_unfinished_requests():
        try:
            finals.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step()
                          if o.finished)
        except EngineStepError as exc:
            failures.append(exc.failed_request_ids)
    assert failures == [["broken"]]
    assert [finals["ok-0"], finals["ok-1"]] == expected


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"json": {"properties": {"a": {"$ref": "#/$defs/missing"}}}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "[a-"}, "structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar"),
])
def test_an_invalid_spec_is_a_value_error_naming_the_field(llm, so, field):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("bad", "Hi", constrained(so))
    assert not engine.has_unfinished_requests()
    engine.add_request("bad", "Hi", SamplingParams(max_tokens=2))  # the id was never taken
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("so, message", [
    ({"json": {}, "regex": "a"}, "exactly one of"),
    ({}, "exactly one of"),
    ({"json_object": False}, "exactly one of"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 1]}, "structured_outputs.choice"),
    ({"json": 5}, "structured_outputs.json"),
    ({"regex": "a", "backend": "outlines"}, "structured_outputs.backend"),
    ({"regex": "a", "whitespace_pattern": " "}, "whitespace_pattern is not supported"),
    ({"regex": "a", "shape": 1}, "unknown key structured_outputs.shape"),
])
def test_malformed_params_fail_when_sampling_params_are_built(so, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=so)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_vocab_rows_are_never_sampled(llm, dtype):
    """The model's vocab may exceed the tokenizer's; a constrained row must not pick a
    padding id even where its logit is the largest. Unconstrained rows are untouched."""
    tokenizer = llm.get_tokenizer()
    vocab = len(tokenizer) + 64
    compiler = GrammarCompiler(tokenizer, vocab, (2,))
    grammar = RequestGrammar.start(compiler.compile(StructuredOutputsParams(json_object=True)))
    free = Request("free", [1, 2], SamplingParams(temperature=0))
    constrained_greedy = Request("c0", [1, 2], SamplingParams(temperature=0))
    constrained_greedy.grammar = grammar
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, -64:] = 100.0
    logits = logits.to(dtype)
    free_row = logits[0].clone()
    sampler = Sampler(seed=0)
    md = sampler.prepare([free, constrained_greedy], vocab, "cpu")
    assert md.argmax_only and md.grammar_rows == [1]  # the free row keeps the fast path
    out = sampler(logits, md).sampled_token_ids.tolist()
    assert out[0] >= len(tokenizer) and torch.equal(logits[0], free_row)
    assert tokenizer.decode([out[1]]).lstrip().startswith("{")
    sampled = Request("c1", [1, 2], SamplingParams(temperature=5.0, seed=1, logprobs=1))
    sampled.grammar = RequestGrammar.start(compiler.compile(StructuredOutputsParams(json_object=True)))
    md = sampler.prepare([free, sampled], vocab, "cpu")
    out = sampler(logits, md)
    assert out.sampled_token_ids[1] < len(tokenizer)
    assert out.sampled_logprobs[1] > -30  # over what the grammar allows, as in vLLM


def test_without_xgrammar_a_constrained_request_is_a_clear_value_error(llm, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import now fails
    compiler = GrammarCompiler(llm.get_tokenizer(), 49152, (2,))
    with pytest.raises(ValueError, match="need the xgrammar package"):
        compiler.compile(StructuredOutputsParams(regex="a+"))
