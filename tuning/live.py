"""Tuning a running server (python -m tuning.tune --server URL ...).

Reads the served model's trace (tuning/server_trace.py), fits the step model, searches
as the offline tuner does, and prints the recommendation. With --apply, and only when
the step model's error on held-out steps is within --max-step-error, loads the model
again with the recommended settings (tuning/apply.py; the replaced config is saved for
--rollback), waits until the old instance has finished what it held (its trace stops
growing), lets traffic run for --window seconds, then replays the new instance's requests
under the new settings with the step model and prints the prediction beside what the
server measured, for the requests that arrived after that wait.

Exit status: 0 done (or nothing to change), 2 refused (the step model is too inexact),
1 the load failed."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from tuning.apply import (Repository, changed_arguments, load_previous, parameters,
                          save_previous, with_parameters)
from tuning.replay import Summary, measured, replay, summarize
from tuning.tables import error_table
from tuning.server_trace import (local_path, next_trace_path, recent, trace_path_of,
                                 wait_drained)
from tuning.step_model import StepModel, held_out_error, step_durations
from tuning.trace_file import Trace, read_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    live = parser.add_argument_group("live server (--server)")
    live.add_argument("--server", metavar="URL", help="tune this Triton server (HTTP, e.g. "
                      "localhost:8000) instead of a trace file")
    live.add_argument("--model", default="llm", help="the served model (default: llm)")
    live.add_argument("--trace", metavar="PATH", help="read the model's trace here instead "
                      "of at its trace_path parameter (same file, another mount)")
    live.add_argument("--recent", type=float, metavar="S",
                      help="use only the trace's last S seconds (default: all of it)")
    live.add_argument("--apply", action="store_true",
                      help="load the model again with the recommended settings")
    live.add_argument("--window", type=float, default=60.0, metavar="S",
                      help="after --apply, measure this long before comparing (default 60)")
    live.add_argument("--max-step-error", type=float, default=0.25, metavar="E",
                      help="refuse --apply when the step model's mean error on held-out "
                           "steps is above E (default 0.25)")
    live.add_argument("--saved-config", type=Path, metavar="PATH",
                      help="where --apply saves the replaced config and --rollback reads "
                           "it (default .tuning/<model>.previous.json)")
    live.add_argument("--rollback", action="store_true",
                      help="load the saved previous config again, then exit")


def run(args: argparse.Namespace, search_and_report) -> int:
    """`search_and_report(trace, model) -> (text, settings)`: the offline tuner's search."""
    saved = args.saved_config or Path(".tuning") / f"{args.model}.previous.json"
    with Repository(args.server) as repo:
        if args.rollback:
            return rollback(repo, args.model, saved)
        return tune_server(repo, args, saved, search_and_report)


def tune_server(repo: Repository, args: argparse.Namespace, saved: Path,
                search_and_report) -> int:
    config = repo.config(args.model)
    server_trace = trace_path_of(config, args.model)
    trace = recent(read_trace(args.trace or server_trace), args.recent)
    model, error = held_out_error(step_durations(trace))
    print(f"{args.server} model {args.model}: {len(trace.requests)} requests, "
          f"{len(trace.steps)} steps; step model held-out error {error['mape']:.1%}")
    if args.apply and error["mape"] > args.max_step_error:
        # Before the search: a recommendation from this model is not one to act on.
        print(f"refusing to apply: the step model's held-out error {error['mape']:.1%} is "
              f"above --max-step-error {args.max_step_error:.0%} (without --apply the "
              "recommendation is still printed)")
        return 2
    text, settings = search_and_report(trace, model)
    print(text)
    if not args.apply:
        return 0
    changes = changed_arguments(trace.engine_args, settings)
    if not changes:
        print("the recommended setting is the running one: nothing to apply")
        return 0
    new_trace = next_trace_path(server_trace)
    save_previous(saved, args.model, config)
    print(f"applying {describe(changes)} (previous config saved to {saved}; "
          f"trace now {new_trace})")
    try:
        repo.reload(args.model, with_parameters(config, {**changes, "trace_path": new_trace}))
    except Exception as exc:  # Triton's error, shown as is; the old instance serves on
        print(f"the load failed: {exc}")
        return 1
    print("loaded; waiting for the old instance to finish its requests")
    drained = wait_drained(local_path(server_trace, args.trace))
    print(f"drained; measuring {args.window:g} s")
    time.sleep(args.window)
    window = read_trace(local_path(new_trace, args.trace))
    print(window_report(window, model, changes, drained))
    return 0


def rollback(repo: Repository, model: str, saved: Path) -> int:
    previous = load_previous(saved, model)
    running = parameters(repo.config(model))
    restored = parameters(previous)
    undo = {k: v for k, v in restored.items() if running.get(k) != v and k != "trace_path"}
    extra = {}
    if "trace_path" in running:  # a fresh file, as after --apply: none is truncated
        extra["trace_path"] = next_trace_path(running["trace_path"])
    print(f"rolling back to the config saved in {saved}: {describe(undo) or 'no change'}")
    try:
        repo.reload(model, with_parameters(previous, extra))
    except Exception as exc:
        print(f"the load failed: {exc}")
        return 1
    print("loaded")
    return 0


def window_report(window: Trace, model: StepModel, changes: dict[str, str],
                  drained_wall: float) -> str:
    """Predicted vs measured for the requests that arrived once the new instance ran
    alone. The replay runs every request of the new trace (the earlier ones load it too)."""
    since = drained_wall - window.header["origin_wall_time"]
    measured_alone = [r for r in window.requests if r["arrival"] >= since]
    if not measured_alone:
        return "no request arrived and finished in the window: nothing to compare"
    applied = {k: window.engine_args.get(k) for k in changes}
    lines = [f"window: {len(measured_alone)} requests (of {len(window.requests)} on the new "
             f"instance) under {describe(applied)}"]
    replayed = replay(window, model).extra["per_request"]
    predicted = summarize([replayed[r["id"]] for r in measured_alone])
    actual = measured(Trace(window.header, measured_alone, []))
    lines.append(comparison(actual, predicted))
    return "\n".join(lines)


def comparison(actual: Summary, predicted: Summary) -> str:
    rows = [("TTFT p50 s", actual.ttft["p50"], predicted.ttft["p50"]),
            ("TTFT p99 s", actual.ttft["p99"], predicted.ttft["p99"]),
            ("ITL p50 s", actual.itl["p50"], predicted.itl["p50"]),
            ("ITL p99 s", actual.itl["p99"], predicted.itl["p99"]),
            ("output tok/s", actual.output_tokens_per_s, predicted.output_tokens_per_s),
            ("preemptions", actual.preemptions, predicted.preemptions)]
    return error_table(rows, ("predicted", "measured"), label_width=16, predicted_first=True)


def describe(values: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())
