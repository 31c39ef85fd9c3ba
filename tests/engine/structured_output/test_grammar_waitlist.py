"""A request whose grammar is compiling waits outside the scheduler (vLLM's
WAITING_FOR_FSM) while every other request is admitted and runs. The compiler here is
held by a gate the test opens, so the order of events, not their timing, is asserted."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import EngineStepError
from testing.tiny_model import make_tiny_model_dir
from tests.engine.structured_output.test_limits import nested

pytestmark = pytest.mark.timeout(300)

CHOICES = ["alpha", "beta"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    tiny = make_tiny_model_dir(tmp_path_factory.mktemp("llama"), arch="llama", seed=3)
    return LLM(str(tiny), dtype="float32", num_kv_blocks=256, block_size=16).llm_engine


class GatedCompiler:
    """The engine's compiler, whose background compiles wait for `gate`. The spec's
    check stays on the caller's thread, as in the engine."""

    def __init__(self, compiler) -> None:
        self.compiler = compiler
        self.gate = threading.Event()
        self.futures: list[Future] = []
        self._pool = ThreadPoolExecutor(1)

    def compile_async(self, params) -> Future:
        self.compiler.check(params)

        def compile_when_let() -> object:
            self.gate.wait()
            return self.compiler.compile(params)

        self.futures.append(self._pool.submit(compile_when_let))
        return self.futures[-1]


@pytest.fixture
def gated(engine, monkeypatch):
    gated = GatedCompiler(engine.grammar_compiler)
    monkeypatch.setattr(engine.grammar_compiler, "compile_async", gated.compile_async,
                        raising=False)  # (the old engine compiled in add_request)
    yield gated
    gated.gate.set()


def constrained(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 20, **kwargs},
                          structured_outputs={"choice": CHOICES})


def free() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def run_until(engine, done, events: list) -> None:
    while not done():
        events.extend((out.request_id, out.finished) for out in engine.step())


def test_a_compiling_request_does_not_hold_back_a_later_one(engine, gated):
    engine.add_request("slow", "Pick:", constrained())
    engine.add_request("free", "Hello", free())
    events: list = []
    run_until(engine, lambda: ("free", True) in events, events)
    # The free request was admitted, ran and finished while the grammar compiled; the
    # constrained one waits outside the scheduler and counts as waiting.
    assert {rid for rid, _ in events} == {"free"}
    assert len(gated.futures) == 1 and not gated.futures[0].done()
    assert "slow" not in engine.scheduler.requests
    assert engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 1
    assert engine.get_stats().num_waiting == 1
    gated.gate.set()
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outputs["slow"].outputs[0].text in CHOICES
    assert outputs["slow"].outputs[0].finish_reason == "stop"


def test_every_sequence_of_n_waits_for_the_one_compile(engine, gated):
    engine.add_request("pair", "Pick:", constrained(n=2, temperature=1.0, seed=4))
    engine.add_request("free", "Hello", free())
    events: list = []
    run_until(engine, lambda: ("free", True) in events, events)
    assert {rid for rid, _ in events} == {"free"} and len(gated.futures) == 1
    assert engine.get_stats().num_waiting == 2
    gated.gate.set()
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["pair"]
    assert len(outputs[0].outputs) == 2 and all(c.text in CHOICES for c in outputs[0].outputs)


def test_a_request_aborted_while_compiling_is_dropped(engine, gated):
    engine.add_request("slow", "Pick:", constrained())
    assert engine.step() == []  # nothing to run: the step waits a little for the compile
    aborted = engine.abort_request("slow")
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in aborted] == [
        ("slow", True, "abort")]
    assert not engine.has_unfinished_requests()
    # The compile ends after the abort; its grammar is never used.
    gated.gate.set()
    gated.futures[0].result()
    assert engine.step() == [] and "slow" not in engine.scheduler.requests
    # The id is free again.
    engine.add_request("slow", "Hello", free())
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["slow"]


def test_a_failed_compile_fails_its_request_alone(engine, monkeypatch):
    def failing_compile(params) -> Future:
        future: Future = Future()
        future.set_exception(RuntimeError("xgrammar ran out of memory"))
        return future

    monkeypatch.setattr(engine.grammar_compiler, "compile_async", failing_compile, raising=False)
    engine.add_request("free", "Hello", free())
    engine.add_request("bad", "Pick:", constrained())
    finished, failures = [], []
    while engine.has_unfinished_requests():
        try:
            finished += [o.request_id for o in engine.step() if o.finished]
        except EngineStepError as exc:
            failures.append((exc.failed_request_ids, str(exc)))
            assert exc.bad_request and not exc.fatal  # the backend answers INVALID_ARG
    assert finished == ["free"]
    assert len(failures) == 1 and failures[0][0] == ["bad"]
    assert "xgrammar ran out of memory" in failures[0][1]


def test_a_spec_over_a_limit_is_refused_by_add_request(engine):
    with pytest.raises(ValueError, match=r"structured_outputs\.json nests 121 levels deep, "
                                         r"over the limit of 64 \(max_json_schema_depth\)"):
        engine.add_request("deep", "Hi", SamplingParams(structured_outputs={"json": nested(60)}))
    assert not engine.has_unfinished_requests()
