"""Speculative decoding's gain, side by side in one run (docs/speculative_decoding.md).

  python -m bench.bench_spec_decode                   # parts 1-4, default sizes
  python -m bench.bench_spec_decode --quick           # tiny sizes (tests/bench's smoke test)
  python -m bench.bench_spec_decode --parts 1 2 --variants ngram
  python -m bench.bench_spec_decode --draft-model PATH   # + {"method": "draft_model", ...}

Parts (--parts):
  1, 2  the embedded SmolLM2-135M with no speculation, ngram, suffix (and draft_model with
        --draft-model, where the engine serves it), the variants alternated round-robin
        (--rounds) so that the host's drift hits all equally. Workloads: *copy*, chat
        prompts ("Repeat this text exactly:", "Fix the typos ...", "Convert to JSON ...")
        quoting a 100-200 token passage the answer echoes; *open*, open questions (single
        stream) and bench_generate's fixed workload (the batch). Single stream: each prompt
        alone, greedy; batch: --num-prompts requests at once. Prints tokens/s, the ratio to
        no speculation, the acceptance rate and the mean tokens a drafting step yields, and
        the issue's targets (single-stream copy >= 2x, open >= 0.95x, batches >= 0.95x).
  3     a random-weight model of Llama-3.2-1B's shape (bench/make_model.py, written once to
        --big-model-dir): a proposer that knows the greedy continuation (from a run that
        proposes nothing) drafts k tokens a step of which a forced share is right; tokens/s
        and decode time per step vs k and the forced acceptance rate, vs k=0 (no drafts).
  4     llama.cpp (llama-cpp-python in --llamacpp-python's venv) on the embedded GGUF file,
        with and without its prompt-lookup decoding, the same single-stream prompts,
        alternated. This file runs itself there (--llamacpp-side); that side imports only
        the standard library and llama_cpp, so the engine's imports sit in the functions.

Over 300 lines: a third is the copy workload's passages (data); the four parts share its
helpers and the round-robin runner.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# --- the copy-heavy workload -------------------------------------------------------------

PASSAGES = [
    "The lighthouse on Gannet Point was built in 1871 from granite quarried two miles inland. "
    "Its keeper, a widower named Thomas Reyne, kept a logbook for thirty-one years, noting the "
    "wind, the ships that passed and the birds that struck the lamp on foggy nights. When the "
    "light was automated in 1962 the logbooks went to the county archive, where a volunteer "
    "later counted more than four thousand entries about herring gulls alone.",
    "To repot a root-bound fern, water it the evening before so the soil holds together. Choose "
    "a pot only one size larger, with a drainage hole, and put a layer of coarse bark at the "
    "bottom. Tease the outer roots loose with your fingers, set the plant at the same depth it "
    "grew before, and fill around it with a mix of peat-free compost and leaf mould. Keep it out "
    "of direct sun for a week while the roots recover.",
    "Our quarterly review found that support tickets fell by eighteen percent after the new "
    "onboarding guide went live. Most of the drop came from password resets and billing "
    "questions, which the guide now answers on its first page. Response times improved as well: "
    "the median first reply took three hours, down from five. The team recommends translating "
    "the guide into Spanish and Portuguese before the summer release.",
    "Maria packed the car at dawn: two suitcases, a cooler of sandwiches, the dog's blanket and a "
    "box of records she refused to leave behind. The road north ran beside the river for an hour "
    "before it climbed into the hills. By noon the fog had lifted, and from the pass she could "
    "see the valley where her grandmother had kept bees, the farmhouse roof still red among the "
    "walnut trees.",
    "A binary search finds a value in a sorted array by halving the range it must look at. It "
    "compares the target with the middle element; if they are equal the search ends, if the "
    "target is smaller it continues in the left half, and otherwise in the right half. Because "
    "the range halves at every step, an array of a million elements needs at most twenty "
    "comparisons. The array must stay sorted for the method to work.",
    "The committee met on Tuesday to discuss the library's opening hours. Several members argued "
    "that the branch should stay open until nine on weekdays, since students use the reading "
    "room after classes. Others worried about the cost of extra staff. In the end the committee "
    "agreed to a six-month trial of late opening on Mondays and Thursdays, with a review of "
    "visitor numbers in the spring.",
    "Sourdough starts with a culture of flour and water left to ferment for several days. Wild "
    "yeasts and lactic acid bacteria feed on the flour, producing gas and a mild sour flavour. "
    "Bakers refresh the culture daily by discarding half and adding fresh flour and water. Once "
    "it doubles within a few hours of feeding, it is strong enough to raise a loaf, which then "
    "needs a long, cool rise before baking.",
    "Please note that the east car park will close from the first of March for resurfacing. "
    "Staff with permits may use the north car park or the overflow field behind the sports hall. "
    "The shuttle bus will run every fifteen minutes between seven and ten in the morning and "
    "again between four and seven in the evening. We apologise for the disruption and expect "
    "the work to finish by the end of April.",
    "Octopuses have three hearts and blue blood. Two hearts pump blood through the gills, while "
    "the third sends it around the rest of the body. Their blood uses a copper-based protein "
    "called haemocyanin to carry oxygen, which works better than iron-based haemoglobin in cold "
    "water with little oxygen. When an octopus swims, the main heart stops beating, which may be "
    "why these animals prefer crawling.",
    "The museum's new wing holds the textile collection: quilts, tapestries, embroidered "
    "samplers and a loom from a mill that closed in 1954. Visitors enter through a gallery of "
    "natural dyes, where jars of madder root, woad and weld sit beside the cloth they coloured. "
    "Guided tours run at eleven and three, and a weaver demonstrates the loom on the first "
    "Saturday of every month.",
    "Before the hike, check the weather forecast and tell someone your route and the time you "
    "expect to return. Carry water, a map, a compass, a torch, a warm layer and a small first "
    "aid kit, even on a short walk. Wear boots that are already broken in. If the cloud comes "
    "down and you lose the path, stop, find your position on the map and take a bearing rather "
    "than guessing the way.",
    "The town council's budget for next year sets aside forty thousand pounds for repairs to "
    "the old market hall, whose roof has leaked since the storms of last winter. A further "
    "twelve thousand will fund new benches and planters along the high street. Councillors "
    "rejected a proposal to raise parking charges, but agreed to review them again in the "
    "autumn after a survey of local shops.",
]
TASKS = [
    "Repeat this text exactly, word for word:\n\n{}",
    "Fix the typos in this paragraph and return it:\n\n{}",
    "Convert this paragraph to JSON of the form {{\"sentences\": [...]}}, one string per "
    "sentence, keeping every word:\n\n{}",
]
OPEN_QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "What are the main causes of inflation, and how do central banks respond to it?",
    "Give me some tips for getting better sleep.",
    "Explain how a bicycle stays upright while it moves.",
    "Describe a perfect day in a city you would like to visit.",
    "What should a beginner know before adopting a cat?",
]


def with_typos(text: str, every: int = 7) -> str:
    """Every `every`-th word of 5+ letters with two inner letters swapped (deterministic)."""
    words = text.split(" ")
    for i in range(3, len(words), every):
        w = words[i]
        if len(w) >= 5 and w.isalpha():
            words[i] = w[0] + w[2] + w[1] + w[3:]
    return " ".join(words)


def rotated(text: str, by: int) -> str:
    """The passage's sentences rotated by `by`: the same text in another order."""
    sentences = [s.strip() for s in text.split(". ") if s.strip()]
    by %= len(sentences)
    return ". ".join(s.rstrip(".") for s in sentences[by:] + sentences[:by]) + "."


def copy_texts(count: int) -> list[str]:
    """`count` distinct copy prompts: passage x task, the passage's sentences rotated on
    each pass over the pairs."""
    texts = []
    for i in range(count):
        task = i // len(PASSAGES) % len(TASKS)
        passage = rotated(PASSAGES[i % len(PASSAGES)], i // (len(PASSAGES) * len(TASKS)))
        texts.append(TASKS[task].format(with_typos(passage) if task == 1 else passage))
    return texts


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True, tokenize=True))
            for t in texts]


# --- sizes and variants ------------------------------------------------------------------

@dataclass
class Sizes:
    single_prompts: int = 4     # single-stream prompts of each workload, one after another
    copy_tokens: int = 256      # max_tokens of a copy prompt (it stops at EOS)
    open_tokens: int = 128      # max_tokens of an open prompt (exact: ignore_eos)
    batch: int = 64             # requests of each batch workload
    rounds: int = 2
    big_tokens: int = 64        # part 3: tokens per point
    big_shape: str = "llama-3.2-1b"


QUICK = Sizes(single_prompts=1, copy_tokens=24, open_tokens=16, batch=4, rounds=1,
              big_tokens=16, big_shape="tiny")


def variant_configs(names: list[str], k: int, draft_model: str | None) -> dict[str, dict | None]:
    configs = {"no spec": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": k,
                         "prompt_lookup_max": 4, "prompt_lookup_min": 2},
               "suffix": {"method": "suffix"}}
    out = {name: configs[name] for name in ["no spec", *names] if name in configs}
    if draft_model:
        out["draft_model"] = {"method": "draft_model", "model": draft_model,
                              "num_speculative_tokens": k}
    return out


def load_variants(configs: dict[str, dict | None], engine_args: dict) -> dict:
    """name -> LLM; a variant the engine refuses is dropped, saying why."""
    from engine import LLM
    llms = {}
    for name, spec in configs.items():
        try:
            llms[name] = LLM(**engine_args, **({"speculative_config": spec} if spec else {}))
        except Exception as exc:  # noqa: BLE001 - any refusal: report it and go on
            print(f"{name}: not available ({type(exc).__name__}: {exc})", flush=True)
    return llms


# --- measuring ---------------------------------------------------------------------------

@dataclass
class Spec:
    """Speculation counters accumulated over one (variant, column)'s timed runs."""
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0

    def add(self, before, after) -> None:
        if before is not None and after is not None:
            self.drafts += after.num_drafts - before.num_drafts
            self.draft_tokens += after.num_draft_tokens - before.num_draft_tokens
            self.accepted += after.num_accepted_tokens - before.num_accepted_tokens

    def cells(self) -> str:
        if not self.draft_tokens:
            return f"{'-':>7}{'-':>6}"
        return f"{self.accepted / self.draft_tokens:>7.0%}{1 + self.accepted / self.drafts:>6.2f}"


@dataclass
class Results:
    tok_s: dict = field(default_factory=dict)   # (variant, column) -> best tok/s
    spec: dict = field(default_factory=dict)    # (variant, column) -> Spec
    texts: dict = field(default_factory=dict)   # variant -> the first copy answer

    def record(self, variant: str, column: str, value: float) -> None:
        key = (variant, column)
        self.tok_s[key] = max(self.tok_s.get(key, 0.0), value)
        print(f"[{time.strftime('%H:%M:%S')}] {variant}, {column}: {value:.1f} tok/s",
              file=sys.stderr, flush=True)


def timed(llm, prompts: list[list[int]], params, results: Results, variant: str,
          column: str) -> tuple[float, int, list]:
    """One generate call: seconds, output tokens, outputs; its speculation counters go to
    results.spec[(variant, column)]."""
    before = llm.llm_engine.get_stats().spec_decoding
    llm.llm_engine.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    results.spec.setdefault((variant, column), Spec()).add(
        before, llm.llm_engine.get_stats().spec_decoding)
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs


def single_stream(llm, prompts, params, results: Results, variant: str, column: str) -> float:
    """Each prompt alone, one after another: output tokens over the summed wall time."""
    seconds = tokens = 0
    for prompt in prompts:
        s, n, outs = timed(llm, [prompt], params, results, variant, column)
        seconds, tokens = seconds + s, tokens + n
        if column.startswith("copy"):
            results.texts.setdefault(variant, outs[0].outputs[0].text)
    return tokens / seconds


def batch(llm, prompts, params, results: Results, variant: str, column: str) -> float:
    seconds, tokens, _ = timed(llm, prompts, params, results, variant, column)
    return tokens / seconds


def engine_columns(tokenizer, sizes: Sizes) -> dict:
    """column -> (measure, prompts, params), in the order they are taken."""
    from bench.bench_generate import make_workload
    from engine import SamplingParams
    copy = SamplingParams(temperature=0, max_tokens=sizes.copy_tokens)
    open_ = SamplingParams(temperature=0, max_tokens=sizes.open_tokens, ignore_eos=True)
    fixed = make_workload("fixed", tokenizer, count=sizes.batch)
    fixed_params = [SamplingParams(temperature=0, max_tokens=min(n, sizes.open_tokens),
                                   ignore_eos=True) for n in fixed.max_tokens]
    return {
        "copy 1x": (single_stream, chat_ids(tokenizer, copy_texts(sizes.single_prompts)), copy),
        "open 1x": (single_stream, chat_ids(tokenizer, OPEN_QUESTIONS[:sizes.single_prompts]), open_),
        f"copy x{sizes.batch}": (batch, chat_ids(tokenizer, copy_texts(sizes.batch)), copy),
        f"open x{sizes.batch}": (batch, fixed.prompts, fixed_params),
    }


def run_rounds(llms: dict, columns: dict, rounds: int) -> Results:
    """Round-robin: every column, each variant in turn, `rounds` times; best counts."""
    from bench.bench_generate import wait_until_quiet
    from engine import SamplingParams
    results = Results()
    for llm in llms.values():  # warm-up
        llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for _ in range(rounds):
        for column, (measure, prompts, params) in columns.items():
            for name, llm in llms.items():
                wait_until_quiet(max_wait_s=5.0)
                results.record(name, column, measure(llm, prompts, params, results, name, column))
    return results


TARGETS = {"copy 1x": 2.0, "open 1x": 0.95}  # batches: 0.95


def print_engine_table(results: Results, variants: list[str], columns: list[str], host: str) -> None:
    print(f"\nparts 1-2: the embedded SmolLM2-135M, output tokens/s (best of the rounds), "
          f"ratio = variant / no spec; host ISA {host}")
    width = max(len(v) for v in variants) + 2
    print(f"{'':<{width}}" + "".join(f"{c:>10}{'ratio':>7}" for c in columns))
    for v in variants:
        cells = ""
        for c in columns:
            value, base = results.tok_s.get((v, c)), results.tok_s.get(("no spec", c))
            cells += f"{value:>10.1f}" if value else f"{'-':>10}"
            cells += f"{value / base:>6.2f}x" if value and base and v != "no spec" else f"{'':>7}"
        print(f"{v:<{width}}{cells}")
    print("acceptance: acc = accepted / draft tokens; len = mean tokens a drafting step yields "
          "(1 + accepted / drafts)")
    print(f"{'':<{width}}" + "".join(f"{c:>13}" for c in columns))
    print(f"{'':<{width}}" + f"{'acc':>7}{'len':>6}" * len(columns))
    for v in variants[1:]:
        print(f"{v:<{width}}" + "".join(results.spec.get((v, c), Spec()).cells() for c in columns))
    print_targets(results, variants, columns)


def print_targets(results: Results, variants: list[str], columns: list[str]) -> None:
    for v in variants:
        if v == "no spec":
            continue
        verdicts = []
        for c in columns:
            value, base = results.tok_s.get((v, c)), results.tok_s.get(("no spec", c))
            if value and base:
                target = TARGETS.get(c, 0.95)
                verdicts.append(f"{c} {value / base:.2f}x {'>=' if value / base >= target else '<'} "
                                f"{target}x")
        print(f"  targets, {v}: " + "; ".join(verdicts))


def print_copy_check(results: Results, chars: int = 160) -> None:
    """The first copy answer, to see by eye that greedy output copies."""
    for v, text in results.texts.items():
        print(f"  {v}, first copy answer: {text[:chars]!r}")


def engine_args(dtype: str, sizes: Sizes) -> dict:
    return dict(model=None, dtype=dtype, max_num_seqs=max(64, sizes.batch),
                max_num_batched_tokens=2048, max_model_len=2048)


def run_parts_1_2(args, sizes: Sizes, host: str) -> None:
    configs = variant_configs(args.variants, args.k, args.draft_model)
    llms = load_variants(configs, engine_args(args.dtype, sizes))
    if "no spec" not in llms:
        raise SystemExit("the engine did not load without speculation")
    columns = engine_columns(llms["no spec"].get_tokenizer(), sizes)
    results = run_rounds(llms, columns, sizes.rounds)
    print_engine_table(results, list(llms), list(columns), host)
    print_copy_check(results)
    for llm in llms.values():
        llm.llm_engine.close()


# --- part 3: verifying k tokens at a forced acceptance rate ------------------------------

class ForcedProposer:
    """Drafts the recorded greedy continuation, of which a forced share is right: over the
    steps, round(rate * drafted) of the drafted tokens lead each draft with the true ones
    (carried as credit from step to step), the rest are wrong (the true token + 1). Drafts
    always hold min(k, limit) tokens, so every step verifies k."""

    def __init__(self, continuations: dict[tuple, list[int]], k: int, rate: float, vocab: int):
        self.continuations, self.k, self.rate, self.vocab = continuations, k, rate, vocab
        self.credit = 0.0
        self.diverged = 0  # drafts made after the request left the recorded continuation

    def propose(self, requests, limits) -> list[list[int]]:
        return [self._draft(r, min(self.k, limit)) for r, limit in zip(requests, limits)]

    def _draft(self, request, n: int) -> list[int]:
        if n <= 0:
            return []
        truth = self.continuations[tuple(request.prompt_token_ids)]
        done = request.all_token_ids[request.num_prompt_tokens:]
        if truth[:len(done)] != done:
            self.diverged += 1
        ahead = truth[len(done):len(done) + n]
        ahead += [0] * (n - len(ahead))
        self.credit += self.rate * n
        good = min(int(self.credit + 1e-9), n)
        self.credit -= good
        return ahead[:good] + [(t + 1) % self.vocab for t in ahead[good:]]

    def finished(self, requests) -> None:
        pass


def big_model(shape: str, folder: Path) -> Path:
    """make_model's random-weight model of `shape`, written once (no GGUF files)."""
    from bench.make_model import make_model
    if not folder.is_dir():
        print(f"writing a random {shape} to {folder} (once)", file=sys.stderr, flush=True)
        partial = folder.with_name(folder.name + ".partial")
        make_model(shape, partial)
        partial.rename(folder)  # whole or not there: a run cut short leaves no half model
    return folder


class ForcedRuns:
    """Part 3's engine with a step counter, its prompt and each point's continuation.

    In bf16 a step that scores k + 1 rows can pick another token than a one-row step at a
    near tie (docs/speculative_decoding.md), and a random-weight model has many: the run
    then leaves the recorded continuation and the forced drafts stop being right. So each
    point with a rate above 0 first settles: its continuation is replaced by its own run's
    output until a run follows it (at most `settle_tries` runs; the drafts of a point are
    deterministic, so the output up to the first divergence repeats and each retry gets
    further). The table reports the measured acceptance beside the forced one."""

    def __init__(self, llm, prompt: list[int], params, vocab: int, settle_tries: int = 4):
        from engine import SamplingParams
        self.llm, self.prompt, self.params, self.vocab = llm, prompt, params, vocab
        self.settle_tries = settle_tries
        self.steps = 0
        step = llm.llm_engine.step

        def counted(*a, **kw):
            self.steps += 1
            return step(*a, **kw)
        llm.llm_engine.step = counted
        plain = self.run(ForcedProposer({}, 0, 0.0, vocab))  # k=0: proposes nothing
        self.truths = {(0, 0.0): {tuple(prompt): plain["out"]}}
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        self.prefill_s = time.perf_counter() - t0

    def run(self, proposer: ForcedProposer) -> dict:
        """tok/s (prefill included), decode ms per step (a 1-token run's time and its step
        taken off), the measured acceptance rate, the output."""
        engine = self.llm.llm_engine
        engine.speculator.proposer = proposer
        before, steps0 = engine.get_stats().spec_decoding, self.steps
        engine.reset_prefix_cache()
        t0 = time.perf_counter()
        out = list(self.llm.generate([self.prompt], self.params, use_tqdm=False)[0].outputs[0].token_ids)
        seconds = time.perf_counter() - t0
        after = engine.get_stats().spec_decoding
        drafted = after.num_draft_tokens - before.num_draft_tokens
        decode_steps = max(self.steps - steps0 - 1, 1)
        return {"tok_s": len(out) / seconds, "out": out, "diverged": proposer.diverged,
                "ms": (seconds - getattr(self, "prefill_s", 0.0)) / decode_steps * 1e3,
                "acc": (after.num_accepted_tokens - before.num_accepted_tokens) / drafted
                if drafted else 0.0}

    def point(self, k: int, rate: float) -> dict:
        truth = self.truths.get((k, rate))
        tries = 0 if truth else self.settle_tries if rate > 0 else 1
        truth = truth or self.truths[(0, 0.0)]
        for _ in range(tries):  # settling (see the class's note)
            r = self.run(ForcedProposer(truth, k, rate, self.vocab))
            if not r["diverged"]:
                break
            truth = {tuple(self.prompt): r["out"]}
        self.truths[(k, rate)] = truth
        return self.run(ForcedProposer(truth, k, rate, self.vocab))


def run_part_3(args, sizes: Sizes, host: str) -> None:
    from bench.bench_generate import make_workload, wait_until_quiet
    from engine import LLM, SamplingParams
    folder = Path(args.big_model_dir or f"/tmp/bench-spec-{sizes.big_shape}")
    llm = LLM(str(big_model(sizes.big_shape, folder)), dtype=args.dtype, max_model_len=2048,
              speculative_config={"method": "ngram", "num_speculative_tokens": max(args.big_ks),
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    prompt = make_workload("fixed", llm.get_tokenizer(), count=1).prompts[0]
    runs = ForcedRuns(llm, prompt, SamplingParams(temperature=0, max_tokens=sizes.big_tokens,
                                                  ignore_eos=True),
                      vocab=json.loads((folder / "config.json").read_text())["vocab_size"])
    points = [(0, 0.0)] + [(k, r) for k in args.big_ks for r in args.rates]
    best: dict = {}
    for _ in range(sizes.rounds):
        for point in points:
            wait_until_quiet(max_wait_s=5.0)
            r = runs.point(*point)
            if r["tok_s"] > best.get(point, {"tok_s": 0})["tok_s"]:
                best[point] = r
    llm.llm_engine.close()
    print_part_3(best, sizes, host, llm_dtype(llm), len(prompt))


def llm_dtype(llm) -> str:
    return str(llm.llm_engine.loaded.dtype).removeprefix("torch.")


def print_part_3(best: dict, sizes: Sizes, host: str, dtype: str, prompt_len: int) -> None:
    print(f"\npart 3: random-weight {sizes.big_shape} ({dtype}), 1 prompt of {prompt_len} tokens "
          f"x {sizes.big_tokens} new, greedy; a proposer drafting the true continuation at a forced "
          f"acceptance rate; host ISA {host}")
    print("ms/step = (wall - a 1-token run's) / decode steps; ratio = tok/s / k=0's (no drafts)")
    base = best[(0, 0.0)]["tok_s"]
    print(f"{'k':>3}{'forced':>8}{'measured':>10}{'tok/s':>9}{'ratio':>8}{'ms/step':>9}")
    for (k, rate), r in best.items():
        tok_s, ms, acc, diverged = r["tok_s"], r["ms"], r["acc"], r["diverged"]
        note = f"  ({diverged} drafts after leaving the recorded continuation)" if diverged else ""
        measured = f"{acc:>10.0%}" if k else f"{'-':>10}"
        forced = f"{rate:>8.0%}" if k else f"{'-':>8}"
        print(f"{k:>3}{forced}{measured}{tok_s:>9.1f}{tok_s / base:>7.2f}x{ms:>9.1f}{note}")


# --- part 4: llama.cpp's prompt-lookup decoding ------------------------------------------

def llamacpp_side(workload_path: str) -> None:
    """Runs in llama-cpp-python's venv: the prompts, alternated with and without
    LlamaPromptLookupDecoding; prints one JSON line."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    w = json.loads(Path(workload_path).read_text())
    threads = len(os.sched_getaffinity(0))
    common = dict(n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512, seed=0,
                  verbose=False)
    sides = {"plain": llama_cpp.Llama(w["gguf"], **common),
             "prompt lookup": llama_cpp.Llama(w["gguf"], draft_model=LlamaPromptLookupDecoding(
                 max_ngram_size=w["ngram"], num_pred_tokens=w["k"]), **common)}
    first = next(iter(w["workloads"].values()))[0]
    for llm in sides.values():  # warm-up
        llamacpp_tok_s(llm, [[first[0], 8, False]])
    best: dict = {}
    for _ in range(w["rounds"]):
        for name in w["workloads"]:
            for side, llm in sides.items():
                tok_s = llamacpp_tok_s(llm, w["workloads"][name])
                best[f"{side}|{name}"] = max(best.get(f"{side}|{name}", 0.0), tok_s)
    print(json.dumps({"version": llama_cpp.__version__, "threads": threads, "tok_s": best}))


def llamacpp_tok_s(llm, cases: list) -> float:
    """Each prompt alone, greedy, up to its max_tokens (stopping at EOS when it may)."""
    seconds = tokens = 0
    for prompt, max_tokens, stop_at_eos in cases:
        llm.reset()
        t0 = time.perf_counter()
        n = 0
        for tok in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            if stop_at_eos and tok == llm.token_eos():
                break
            n += 1
            if n == max_tokens:
                break
        seconds, tokens = seconds + time.perf_counter() - t0, tokens + n
    return tokens / seconds


def run_part_4(args, sizes: Sizes, host: str) -> None:
    from engine.models.gguf_cache import default_gguf_path
    print(f"\npart 4: llama.cpp on the embedded GGUF, single stream, with and without "
          f"LlamaPromptLookupDecoding (k={args.k}, max n-gram 4); host ISA {host}")
    if not args.llamacpp_python or not Path(args.llamacpp_python).exists():
        print(f"  skipped: no llama-cpp-python venv ({args.llamacpp_python or 'no --llamacpp-python'})")
        return
    workload = llamacpp_workload(args, sizes, str(default_gguf_path()))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    proc = subprocess.run([args.llamacpp_python, __file__, "--llamacpp-side", f.name],
                          capture_output=True, text=True)
    os.unlink(f.name)
    if proc.returncode != 0:
        print(f"  llama.cpp side failed ({proc.returncode}): {proc.stderr.strip()[-600:]}")
        return
    print_part_4(json.loads(proc.stdout.strip().splitlines()[-1]))


def llamacpp_workload(args, sizes: Sizes, gguf: str) -> dict:
    from transformers import AutoTokenizer
    from engine.models import resolve_model_dir
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))  # the GGUF's own
    copy = [(p, sizes.copy_tokens, True) for p in chat_ids(tokenizer, copy_texts(sizes.single_prompts))]
    open_ = [(p, sizes.open_tokens, False)
             for p in chat_ids(tokenizer, OPEN_QUESTIONS[:sizes.single_prompts])]
    return {"gguf": gguf, "k": args.k, "ngram": 4, "rounds": sizes.rounds,
            "workloads": {"copy 1x": copy, "open 1x": open_}}


def print_part_4(result: dict) -> None:
    print(f"  llama-cpp-python {result['version']}, {result['threads']} threads; tokens/s, "
          "ratio = prompt lookup / plain")
    tok_s = result["tok_s"]
    for name in ("copy 1x", "open 1x"):
        plain, lookup = tok_s[f"plain|{name}"], tok_s[f"prompt lookup|{name}"]
        print(f"  {name}: plain {plain:.1f}, prompt lookup {lookup:.1f}, {lookup / plain:.2f}x")


# --- command line ------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test's)")
    ap.add_argument("--parts", nargs="+", type=int, choices=[1, 2, 3, 4], default=[1, 2, 3, 4],
                    help="1 and 2 run together (single stream and batches)")
    ap.add_argument("--variants", nargs="+", choices=["ngram", "suffix"], default=["ngram", "suffix"],
                    help="besides no speculation (and --draft-model's)")
    ap.add_argument("--draft-model", metavar="PATH", help="+ the draft_model method with this draft")
    ap.add_argument("-k", type=int, default=4, help="num_speculative_tokens of ngram, draft_model "
                    "and llama.cpp's prompt lookup")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rounds", type=int, help="alternations (default 2, --quick 1)")
    ap.add_argument("--num-prompts", type=int, help="requests per batch (default 64, --quick 4)")
    ap.add_argument("--single-prompts", type=int, help="prompts per single-stream column (default 4)")
    ap.add_argument("--big-ks", nargs="+", type=int, default=[1, 2, 4, 8], help="part 3's k values")
    ap.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.5, 1.0],
                    help="part 3's forced acceptance rates")
    ap.add_argument("--big-tokens", type=int, help="part 3's new tokens per point (default 64)")
    ap.add_argument("--big-model-dir", help="part 3's model folder (default /tmp/bench-spec-SHAPE, "
                    "written once by bench/make_model.py)")
    ap.add_argument("--llamacpp-python", default="/tmp/llama-venv/bin/python",
                    help="python of a venv with llama-cpp-python (bench/llamacpp_peer.py)")
    ap.add_argument("--llamacpp-side", metavar="JSON", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def sizes_for(args) -> Sizes:
    sizes = Sizes(**vars(QUICK)) if args.quick else Sizes()
    for name, value in (("rounds", args.rounds), ("batch", args.num_prompts),
                        ("single_prompts", args.single_prompts), ("big_tokens", args.big_tokens)):
        if value:
            setattr(sizes, name, value)
    return sizes


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.llamacpp_side:
        return llamacpp_side(args.llamacpp_side)
    import torch
    from kernels.cpu import features
    sizes = sizes_for(args)
    host = f"{features.detect().describe()}, threads={torch.get_num_threads()}"
    if {1, 2} & set(args.parts):
        run_parts_1_2(args, sizes, host)
    if 3 in args.parts:
        run_part_3(args, sizes, host)
    if 4 in args.parts:
        run_part_4(args, sizes, host)


if __name__ == "__main__":
    main()
