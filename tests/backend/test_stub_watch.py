"""backend/stub_watch.StubWatch over real processes standing in for stubs; the server's
repository answers are a fake (the e2e test tests/e2e/test_stub_faults.py kills a real
stub under a real tritonserver)."""
import subprocess

import pytest

from backend import stub_watch
from backend.stub_watch import Stub, StubWatch


@pytest.fixture
def world(monkeypatch):
    """A live process listed as the llm model's stub, and the model state the server
    answers (None: no answer in time)."""
    proc = subprocess.Popen(["sleep", "60"])
    stub = Stub(proc.pid, stub_watch._stat(proc.pid)[19], "llm", "llm_0_0")
    state = {"listed": [stub], "answer": "READY"}
    monkeypatch.setattr(stub_watch, "stubs_of", lambda pgid: list(state["listed"]))
    monkeypatch.setattr(stub_watch, "model_state",
                        lambda url, model, timeout=5.0, headers=None: state["answer"])
    yield proc, stub, state
    proc.kill()
    proc.wait()


def _kill(proc, state):
    proc.kill()
    proc.wait()
    state["listed"] = []


def test_a_dead_stub_of_a_loaded_model_is_reported_once(world):
    proc, stub, state = world
    watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
    assert watch.died() == []  # learns the stub
    assert watch.died() == []  # alive
    _kill(proc, state)
    assert watch.died() == [stub]
    assert watch.died() == []


def test_a_death_seen_while_the_server_does_not_answer_is_reported_when_it_does(world):
    proc, stub, state = world
    watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
    watch.died()
    _kill(proc, state)
    state["answer"] = None  # the server too busy to answer within the timeout
    assert watch.died() == []
    assert watch.died() == []
    state["answer"] = "READY"
    assert watch.died() == [stub]
    assert watch.died() == []


def test_a_stub_leaving_with_its_unloaded_model_is_not_a_death(world):
    proc, stub, state = world
    watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
    watch.died()
    _kill(proc, state)
    state["answer"] = "UNAVAILABLE"
    assert watch.died() == []
    state["answer"] = "READY"  # a later load of the model: the old stub stays forgotten
    assert watch.died() == []
