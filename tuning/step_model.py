"""Step time as a linear function of what the step scheduled, fitted on recorded steps:

    seconds = a + b * prefill_tokens + c * decode_tokens + d * context_tokens
              + e * num_prefills

(a: the fixed cost of a step; b, c: per token of each kind, the matmuls; d: attention
over the context; e: per prefill chunk.) A step's time is taken from its start to the
next step's start while the engine stayed busy, so what a step costs outside the
recorded span (outputs, detokenizing) is in the model too.

    python -m tuning.step_model TRACE [--out MODEL.json]
prints the fit and its error on held-out steps (every fifth step).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np

from tuning.trace_file import Trace, read_trace

FEATURES = ("prefill_tokens", "decode_tokens", "context_tokens", "num_prefills")


@dataclass(slots=True)
class StepModel:
    intercept: float
    coefficients: dict[str, float]
    floor: float  # the fastest recorded step: predictions never go below it

    def predict(self, features: dict[str, int]) -> float:
        value = self.intercept + sum(c * features[name] for name, c in self.coefficients.items())
        return max(self.floor, value)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "StepModel":
        return cls(**json.loads(text))


def step_durations(trace: Trace) -> list[tuple[dict, float]]:
    """(features, seconds) per step: start to the next start when the gap between them
    is overhead (under half the step and 5 ms), else the step's own wall time."""
    steps = trace.steps
    out = []
    for step, following in zip(steps, steps[1:] + [None]):
        seconds = step["wall"]
        if following is not None:
            gap = following["start"] - (step["start"] + step["wall"])
            if 0 <= gap < min(0.005, 0.5 * step["wall"]):
                seconds = following["start"] - step["start"]
        out.append((step, seconds))
    return out


def _matrix(rows: list[dict]) -> np.ndarray:
    return np.array([[1.0, *(float(r[name]) for name in FEATURES)] for r in rows])


def fit(samples: list[tuple[dict, float]]) -> StepModel:
    if len(samples) < len(FEATURES) + 1:
        raise ValueError(f"{len(samples)} steps are too few to fit {len(FEATURES) + 1} terms")
    x = _matrix([f for f, _ in samples])
    y = np.array([s for _, s in samples])
    # Relative error matters (a 1 ms decode and a 1 s prefill alike): weight by 1/y.
    w = 1.0 / np.maximum(y, 1e-4)
    solution, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    return StepModel(float(solution[0]), dict(zip(FEATURES, map(float, solution[1:]))),
                     float(y.min()))


def held_out_error(samples: list[tuple[dict, float]]) -> tuple[StepModel, dict[str, float]]:
    """Fit on four steps in five, report the error on the fifth; then fit on all."""
    test = samples[4::5]
    train = [s for i, s in enumerate(samples) if i % 5 != 4]
    model = fit(train)
    predicted = np.array([model.predict(f) for f, _ in test])
    actual = np.array([s for _, s in test])
    relative = np.abs(predicted - actual) / actual
    summary = {"held_out_steps": len(test), "mape": float(relative.mean()),
               "median_ape": float(np.median(relative)),
               "p90_ape": float(np.percentile(relative, 90)),
               "total_time_error": float(predicted.sum() / actual.sum() - 1)}
    return fit(samples), summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--out", help="write the fitted model here (JSON)")
    args = parser.parse_args(argv)
    trace = read_trace(args.trace)
    model, error = held_out_error(step_durations(trace))
    print(f"{len(trace.steps)} steps, host {trace.header.get('host')}, "
          f"dtype {trace.header.get('dtype')}")
    terms = " + ".join(f"{c * 1e6:.2f}us*{name}" for name, c in model.coefficients.items())
    print(f"step = {model.intercept * 1e3:.3f} ms + {terms}")
    print(f"held-out ({error['held_out_steps']} steps): mean abs error {error['mape']:.1%}, "
          f"median {error['median_ape']:.1%}, p90 {error['p90_ape']:.1%}; "
          f"total time {error['total_time_error']:+.1%}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(model.to_json())


if __name__ == "__main__":
    main()
