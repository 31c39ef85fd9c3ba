"""Structured outputs: what half a batch under a JSON schema costs the batch, the grammar
work per step on its own, and grammar compile time (cold and cached).

Default model: the embedded SmolLM2-135M-Instruct (`--model PATH` for another). Tokens/s
counts what each batch generated: a grammar may end its output early, so the batches are
compared by rate, not by wall time."""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine import LLM, SamplingParams
from engine.core.request import Request
from engine.sample.sampler import Sampler
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.grammar import GrammarCompiler, RequestGrammar

PROMPTS = ["List the fruits you know as JSON.", "Name some rivers of Europe.",
           "Write the days of the week.", "Give a list of colours in French.",
           "Which programming languages do you know?", "List animals of the savanna.",
           "Name ten cities in Asia.", "Write the planets of the solar system."]
# Outputs as long as the free ones: SmolLM2 closed an open array after 3 tokens, which
# left a batch of 8 for most of the run (-29% "overhead" that was only the smaller batch).
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 100}
MID_SCHEMA = {  # 25 properties, 4 levels, arrays, enums, patterns, formats, ranges, a $ref
    "$defs": {"Address": {"type": "object", "properties": {
        "street": {"type": "string"}, "city": {"type": "string", "maxLength": 40},
        "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "country": {"enum": ["FR", "DE", "IT", "ES", "GB", "US"]}},
        "required": ["street", "city", "zip", "country"]}},
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1}, "name": {"type": "string", "maxLength": 80},
        "email": {"type": "string", "format": "email"}, "age": {"type": "integer", "minimum": 0,
                                                               "maximum": 150},
        "score": {"type": "number"}, "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "home": {"$ref": "#/$defs/Address"}, "work": {"$ref": "#/$defs/Address"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 10},
        "phones": {"type": "array", "items": {"type": "object", "properties": {
            "kind": {"enum": ["home", "mobile", "work"]},
            "number": {"type": "string", "pattern": "^\\+?[0-9 ]{6,20}$"}},
            "required": ["kind", "number"]}},
        "created": {"type": "string", "format": "date-time"},
        "settings": {"type": "object", "properties": {
            "theme": {"enum": ["light", "dark"]}, "language": {"type": "string"},
            "notifications": {"type": "object", "properties": {
                "email": {"type": "boolean"}, "sms": {"type": "boolean"},
                "frequency": {"enum": ["daily", "weekly", "never"]}}}},
            "required": ["theme"]},
    },
    "required": ["id", "name", "email", "role", "home"],
}


def batch_rate(llm: LLM, constrained: int, batch: int, max_tokens: int, temperature: float
               ) -> tuple[float, int, int]:
    """(tokens/s, tokens generated, tokens of the constrained requests)."""
    # ignore_eos alone fixes the length and keeps a greedy batch on the fused argmax.
    free = SamplingParams(temperature=temperature, seed=1, max_tokens=max_tokens, ignore_eos=True)
    json_params = SamplingParams(temperature=temperature, seed=1, max_tokens=max_tokens,
                                 structured_outputs={"json": LONG_SCHEMA})
    params = [json_params if i % 2 and i // 2 < constrained else free for i in range(batch)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outs]
    grammar_tokens = sum(c for c, p in zip(counts, params) if p is json_params)
    return sum(counts) / elapsed, sum(counts), grammar_tokens


def step_overhead_us(llm: LLM, rows: int, constrained: int, repeats: int = 200) -> float:
    """Sampler time per step for `rows` greedy rows, `constrained` of them under the schema,
    minus the same batch unconstrained: the grammar's share of a step."""
    engine = llm.llm_engine
    vocab = engine.loaded.vocab_size
    compiled = engine.grammar_compiler.compile(StructuredOutputsParams(json=MID_SCHEMA))
    requests = [Request(str(i), [1, 2], SamplingParams(temperature=0)) for i in range(rows)]
    logits = torch.randn(rows, vocab)

    def per_step() -> float:
        sampler = Sampler(seed=0)
        sampler(logits, sampler.prepare(requests, vocab, "cpu"))
        start = time.perf_counter()
        for _ in range(repeats):
            sampler(logits, sampler.prepare(requests, vocab, "cpu"))
        return (time.perf_counter() - start) / repeats * 1e6

    base = per_step()
    for request in requests[:constrained]:
        request.grammar = RequestGrammar.start(compiled)
        # Inside a free string, the costliest place: most of the vocabulary must be checked.
        request.grammar.matcher.accept_string('{"id": 7, "name": "Ada')
    return per_step() - base


def compile_times_ms(llm: LLM, repeats: int = 5) -> tuple[float, float, float]:
    """(tokenizer vocabulary set-up, cold compile, cached compile) of MID_SCHEMA."""
    engine = llm.llm_engine
    spec = StructuredOutputsParams(json=MID_SCHEMA)
    colds, setups = [], []
    for _ in range(repeats):
        compiler = GrammarCompiler(engine.tokenizer, engine.loaded.vocab_size, engine.eos_token_ids)
        start = time.perf_counter()
        compiler.compile(StructuredOutputsParams(json_object=True))  # builds the vocabulary
        setups.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(spec)
        colds.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(100):
        compiler.compile(StructuredOutputsParams(json=MID_SCHEMA))
    cached = (time.perf_counter() - start) / 100
    return (statistics.median(setups) * 1e3, statistics.median(colds) * 1e3, cached * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(args.model, num_kv_blocks=1024)
    setup, cold, cached = compile_times_ms(llm)
    print(f"grammar compile, 25-property schema: cold {cold:.1f} ms, "
          f"cached {cached * 1e3:.1f} us; tokenizer set-up once per engine {setup:.0f} ms")
    for rows, constrained in ((16, 8), (64, 32)):
        print(f"sampler grammar work, {constrained} of {rows} greedy rows constrained: "
              f"{step_overhead_us(llm, rows, constrained):.0f} us/step")
    half = args.batch // 2
    for temperature in (0.0, 1.0):
        batch_rate(llm, 0, args.batch, 16, temperature)  # warm-up
        free, mixed = [], []
        for _ in range(args.rounds):  # interleaved: a busy neighbour hits both alike
            free.append(batch_rate(llm, 0, args.batch, args.max_tokens, temperature))
            mixed.append(batch_rate(llm, half, args.batch, args.max_tokens, temperature))
        f = statistics.median(r[0] for r in free)
        m = statistics.median(r[0] for r in mixed)
        grammar_tokens = statistics.median(r[2] for r in mixed)
        print(f"batch {args.batch}, temperature {temperature}: free {f:.0f} tok/s, {half} under a "
              f"JSON schema {m:.0f} tok/s ({(m / f - 1) * 100:+.1f}%; constrained requests made "
              f"{grammar_tokens:.0f} of {half * args.max_tokens} possible tokens)")


if __name__ == "__main__":
    main()
