"""The benchmark's synthetic workload: seeded prompts, exact output lengths, Poisson arrivals.

Distribution (stated so results can be reproduced and compared):
  - prompt: k words drawn uniformly with replacement from WORDS, k ~ Uniform{a..b}
  - output: n tokens, n ~ Uniform{c..d}; sent as max_tokens = min_tokens = n with
    ignore_eos, so every request generates exactly n tokens whatever the model says
  - open loop: inter-arrival gaps ~ Exponential(mean 1/rate), i.e. Poisson arrivals
Everything comes from one numpy Generator seeded with --seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Common English words, so prompts tokenize to roughly one token per word.
WORDS = (
    "the of and to in is was that for it with as on be at by this had not are but from or have "
    "an they which one you were all we her she there would their will when who him been has more "
    "if no out so said what up its about into than them can only other new some time could these "
    "two may first then do any like my now over such our man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three house water light music river garden market story"
).split()


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_words: tuple[int, int]  # inclusive range
    output_tokens: tuple[int, int]  # inclusive range
    seed: int = 0

    def describe(self) -> str:
        a, b = self.prompt_words
        c, d = self.output_tokens
        return (f"prompt words ~ U{{{a}..{b}}} from a {len(WORDS)}-word list; "
                f"output tokens ~ U{{{c}..{d}}} (min_tokens = max_tokens, ignore_eos); seed {self.seed}")


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    output_tokens: int

    def sampling(self) -> dict:
        n = self.output_tokens
        return {"max_tokens": n, "min_tokens": n, "ignore_eos": True, "temperature": 0.0}


def make_requests(spec: WorkloadSpec) -> list[RequestSpec]:
    a, b = spec.prompt_words
    c, d = spec.output_tokens
    if not (1 <= a <= b and 1 <= c <= d):
        raise ValueError(f"bad ranges: prompt_words={spec.prompt_words} output_tokens={spec.output_tokens}")
    rng = np.random.default_rng(spec.seed)
    requests = []
    for _ in range(spec.num_requests):
        k = int(rng.integers(a, b + 1))
        words = rng.choice(len(WORDS), size=k, replace=True)
        n = int(rng.integers(c, d + 1))
        requests.append(RequestSpec(" ".join(WORDS[i] for i in words), n))
    return requests


def poisson_arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets in seconds from the start; rate=inf sends everything at once."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()
