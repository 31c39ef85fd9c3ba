"""Stop-string work per engine step: the old scan of every stop string against the text
versus the Aho-Corasick matcher (engine/output/stop_strings.py), and the matcher's one-time build.

A step appends a few characters (one token's worth) and asks two things: did a stop string
appear, and how much of the tail must be held back. Both are timed on the same text, random
or made of broken-off stop prefixes ("near"), at the output length given; no stop string
occurs in it, so every step does the full work.
"""
from __future__ import annotations

import argparse
import random
import time

from engine.output.stop_strings import StopAutomaton, StopMatcher

ALPHABET = "abcdefgh "  # small, so the text keeps beginning partial matches


class NaiveStops:
    """The detokenizer's stop handling before the matcher, kept as the baseline."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.max_len = max(len(s) for s in stops)

    def find(self, text: str, new_start: int) -> str | None:
        search_from = max(0, new_start - self.max_len + 1)
        best = None
        for stop in self.stops:
            at = text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        return None if best is None else best[1]

    def partial_len(self, text: str) -> int:
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


def random_text(rng: random.Random, length: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(length))


def near_miss_text(rng: random.Random, stops: list[str], length: int) -> str:
    """Long prefixes of the stops, each broken off by a character no stop has: the matcher's
    costly case (deep partial matches, then a walk down the failure links)."""
    text = ""
    while len(text) < length:
        stop = rng.choice(stops)
        text += stop[:rng.randint(1, len(stop) - 1)] + "z"
    return text[:length]


def naive_step_ms(stops: list[str], text: str, step_chars: int, steps: int) -> float:
    """Per-step cost once the output has reached len(text) characters."""
    naive = NaiveStops(stops)
    t0 = time.perf_counter()
    for _ in range(steps):
        assert naive.find(text, len(text) - step_chars) is None
        naive.partial_len(text)
    return (time.perf_counter() - t0) / steps * 1e3


def matcher_step_us(stops: list[str], text: str, step_chars: int) -> tuple[float, float]:
    """Mean and 99th-percentile per-step cost over the stream up to len(text) characters
    (the maximum on a shared 2-core host mostly measures preemption, not the matcher)."""
    matcher = StopMatcher(stops)
    times = []
    for end in range(step_chars, len(text) + 1, step_chars):
        t0 = time.perf_counter()
        assert matcher.feed(text[:end], end - step_chars) is None
        matcher.partial_len
        times.append(time.perf_counter() - t0)
    times.sort()
    return sum(times) / len(times) * 1e6, times[int(0.99 * (len(times) - 1))] * 1e6


def build_ms(stops: list[str]) -> float:
    t0 = time.perf_counter()
    StopAutomaton(stops)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output-chars", type=int, default=4000)
    parser.add_argument("--step-chars", type=int, default=4, help="characters per step (token)")
    parser.add_argument("--naive-steps", type=int, default=10)
    args = parser.parse_args()
    rng = random.Random(0)
    print(f"output {args.output_chars} chars, {args.step_chars} chars per step")
    print(f"{'stops':>7} {'chars':>6} {'text':>6} | {'naive ms/step':>13} | "
          f"{'matcher us/step':>15} {'p99 us':>9} | {'build ms':>8}")
    for count, length, kind in [(4, 16, "random"), (256, 64, "random"), (16, 1024, "random"),
                                (200, 1000, "random"), (200, 1000, "near"), (10_000, 10, "random")]:
        stops = [random_text(rng, length) for _ in range(count)]
        text = (random_text(rng, args.output_chars) if kind == "random"
                else near_miss_text(rng, stops, args.output_chars))
        naive = naive_step_ms(stops, text, args.step_chars, args.naive_steps)
        mean, p99 = matcher_step_us(stops, text, args.step_chars)
        print(f"{count:>7} {length:>6} {kind:>6} | {naive:>13.3f} | {mean:>15.2f} {p99:>9.1f} | "
              f"{build_ms(stops):>8.1f}")


if __name__ == "__main__":
    main()
