"""Structured-output specs are bounded by their size before xgrammar sees them; the
defaults admit what the OpenAI and vLLM docs show, and the compiled-grammar cache keeps
to its byte limit."""
from __future__ import annotations

import json
import re

import pytest

from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.grammar import GrammarCompiler
from engine.structured_output.limits import DEFAULT_LIMITS, StructuredOutputLimits, check_limits
from testing.tiny_model import make_tiny_model_dir
from tests.engine.structured_output.test_structured_output import SCHEMAS


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_text(levels: int) -> str:
    """nested(levels) as JSON text, built without json.dumps (which recurses)."""
    return ('{"type": "object", "required": ["a"], "properties": {"a": ' * levels
            + '{"type": "string"}' + "}}" * levels)


# OpenAI's structured-outputs guide: chain of thought, a recursive UI tree and a
# moderation result; vLLM's docs: the car description, its e-mail regex, its choice and
# its SQL grammar.
OPENAI_MATH = {
    "type": "object", "additionalProperties": False, "required": ["steps", "final_answer"],
    "properties": {
        "steps": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["explanation", "output"],
            "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}}}},
        "final_answer": {"type": "string"}}}
OPENAI_UI = {
    "type": "object", "additionalProperties": False,
    "required": ["type", "label", "children", "attributes"],
    "properties": {
        "type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
        "label": {"type": "string"},
        "children": {"type": "array", "items": {"$ref": "#"}},
        "attributes": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "value"],
            "properties": {"name": {"type": "string"}, "value": {"type": "string"}}}}}}
OPENAI_MODERATION = {
    "type": "object", "additionalProperties": False,
    "required": ["is_violating", "category", "explanation_if_violating"],
    "properties": {
        "is_violating": {"type": "boolean"},
        "category": {"type": ["string", "null"], "enum": ["violence", "sexual", "self_harm"]},
        "explanation_if_violating": {"type": ["string", "null"]}}}
VLLM_CAR = {
    "type": "object", "required": ["brand", "model", "car_type"], "title": "CarDescription",
    "properties": {"brand": {"type": "string", "title": "Brand"},
                   "model": {"type": "string", "title": "Model"},
                   "car_type": {"$ref": "#/$defs/CarType"}},
    "$defs": {"CarType": {"type": "string", "title": "CarType",
                          "enum": ["sedan", "SUV", "Truck", "Coupe"]}}}
VLLM_SQL = """root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


@pytest.mark.parametrize("spec", [
    *({"json": adapter.json_schema()} for adapter in SCHEMAS.values()),
    {"json": OPENAI_MATH}, {"json": OPENAI_UI}, {"json": json.dumps(OPENAI_MODERATION)},
    {"json": VLLM_CAR}, {"json_object": True},
    {"regex": r"\w+@\w+\.com\n"}, {"regex": r"[a-z]{2,5}-[0-9]{2,4}(\.[0-9])?"},
    {"choice": ["positive", "negative"]}, {"grammar": VLLM_SQL},
    # OpenAI's own caps: 10 levels of nesting, 1,000 enum values.
    {"json": nested(10)}, {"choice": [f"value {i}" for i in range(1000)]},
])
def test_the_defaults_admit_the_documented_specs(spec):
    check_limits(StructuredOutputsParams(**spec), DEFAULT_LIMITS)


SMALL = StructuredOutputLimits(max_json_schema_bytes=2000, max_json_schema_depth=8,
                               max_choices=4, max_choice_bytes=20, max_regex_bytes=30,
                               max_regex_repeat=50, max_grammar_bytes=40)


@pytest.mark.parametrize("spec, limit", [
    ({"json": nested(3)}, None),  # 7 levels of JSON
    ({"json": nested(4)}, "max_json_schema_depth"),
    ({"json": json.dumps(nested(4))}, "max_json_schema_depth"),
    # Brackets inside strings are not nesting.
    ({"json": json.dumps({"description": "[[[[{{{{[[[[", "type": "string"})}, None),
    ({"json": {"type": "string", "description": "x" * 2000}}, "max_json_schema_bytes"),
    ({"json": json.dumps({"type": "string", "description": "é" * 1000})}, "max_json_schema_bytes"),
    ({"json": {"type": "string", "pattern": "^a{51}$"}}, "max_regex_repeat"),
    ({"choice": ["a", "b", "c", "d"]}, None),
    ({"choice": ["a", "b", "c", "d", "e"]}, "max_choices"),
    ({"choice": ["0123456789", "0123456789", "x"]}, "max_choice_bytes"),
    ({"regex": "[a-z]" * 7}, "max_regex_bytes"),
    ({"regex": "a{50}(b{2,50}){1,}"}, None),
    ({"regex": "a{51}"}, "max_regex_repeat"),
    ({"regex": "(ab){3,51}"}, "max_regex_repeat"),
    ({"regex": "a{1," + "9" * 20 + "}"}, "max_regex_repeat"),
    # Braces escaped or inside a class are characters, not counts.
    ({"regex": r"\{999}[{999}]x"}, None),
    ({"regex": r"[]{999}]a{51}"}, "max_regex_repeat"),
    ({"grammar": 'root ::= "' + "a" * 40 + '"'}, "max_grammar_bytes"),
])
def test_each_limit_refuses_naming_itself(spec, limit):
    params = StructuredOutputsParams(**spec)
    if limit is None:
        check_limits(params, SMALL)
        return
    with pytest.raises(ValueError, match=re.escape(f"({limit})")) as refused:
        check_limits(params, SMALL)
    assert str(refused.value).startswith(f"structured_outputs.{params.kind}")


def test_a_700_deep_schema_is_refused_by_the_check_without_compiling():
    """The issue's 43 KB schema took 65.7 s to compile; refused, it never reaches xgrammar
    (a compiler without a tokenizer could not compile anything)."""
    schema = nested_text(700)
    assert len(schema) > 40_000
    compiler = GrammarCompiler(None, 49152, (2,))
    with pytest.raises(ValueError, match=r"structured_outputs\.json nests 1401 levels deep, "
                                         r"over the limit of 64 \(max_json_schema_depth\)"):
        compiler.check(StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=re.escape("(max_choices)")):
        compiler.check(StructuredOutputsParams(choice=[str(i) for i in range(20_000)]))


def test_the_compiled_grammar_cache_keeps_to_its_byte_limit(tmp_path):
    """Salted schemas (each its own cache entry, ~4 MB with this vocabulary) past the
    limit: xgrammar drops the least recently used, so the cache stays within the limit
    plus the newest grammar (unbounded, it held all 8: 36 MB)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model_dir(tmp_path))
    limit = 8 << 20
    compiler = GrammarCompiler(tokenizer, 49152, (2,), cache_limit_bytes=limit)
    sizes = []
    for salt in range(8):
        schema = {"type": "object", "properties": {f"salt_{salt}": {"type": "string"},
                                                   "n": {"type": "integer"}}}
        sizes.append(compiler.compile(StructuredOutputsParams(json=schema)).memory_size_bytes)
    assert sum(sizes) > 2 * limit  # the cache had to drop some
    assert compiler.cache_size_bytes <= limit + max(sizes)
    compiler.close()


@pytest.mark.parametrize("spec", [{"regex": "[a-z]+"}, {"json": json.dumps(VLLM_CAR)},
                                  {"json": VLLM_CAR}, {"choice": ["a", "b"]}])
def test_a_checked_spec_is_kept_for_the_engine_threads_check(spec):
    """Triton's thread checks and parses; add_request's check of the same spec is then a
    look-up (the same parsed grammar), not a second parse on the engine thread."""
    compiler = GrammarCompiler(None, 49152, (2,))
    first = compiler.check(StructuredOutputsParams(**spec))
    assert compiler.check(StructuredOutputsParams(**spec)) is first
    other = compiler.check(StructuredOutputsParams(**spec, disable_any_whitespace=True))
    assert other is not first
