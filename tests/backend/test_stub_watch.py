"""backend/stub_watch.StubWatch over real processes standing in for stubs; the server's
repository answers are a fake (the e2e test tests/e2e/test_stub_faults.py kills a real
stub under a real tritonserver)."""
import signal
import subprocess
import time

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


def test_an_auto_complete_stub_leaving_a_ready_model_is_not_a_death(world):
    """Mirrors vllm_backend's L0_backend_vllm/vllm_backend test_vllm_triton_backend, which
    loads python_backend's add_sub at run time (explicit model control): its short-lived
    auto-complete stub, named after the model, exits while add_sub is READY; serve took it
    for a dead instance and killed tritonserver every time."""
    proc, stub, state = world
    autocomplete = subprocess.Popen(["sleep", "60"])
    try:
        ac = Stub(autocomplete.pid, stub_watch._stat(autocomplete.pid)[19], "add_sub", "add_sub")
        assert ac.autocomplete and not stub.autocomplete
        state["listed"] = [stub, ac]
        watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
        assert watch.died() == []
        autocomplete.kill()
        autocomplete.wait()
        state["listed"] = [stub]
        assert watch.died() == []  # add_sub READY: still not a death
        _kill(proc, state)
        assert watch.died() == [stub]  # an instance stub is still watched
    finally:
        autocomplete.kill()
        autocomplete.wait()


def test_a_stub_killed_while_its_model_is_loaded_is_named_with_its_signal(world):
    proc, stub, state = world
    watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
    watch.died()
    proc.kill()  # not reaped: a zombie, as under tritonserver, which does not reap it
    deadline = time.monotonic() + 10
    while stub.alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    state["listed"] = []
    assert watch.died() == [stub]
    message = str(stub_watch.StubDied([stub], watch.statuses))
    assert f"llm_0_0 (model llm, pid {stub.pid}, killed by SIGKILL)" == message


def test_a_stub_crashing_during_a_graceful_stop_is_reported_with_its_signal(world):
    """scripts/serve.py logs it (`serve: backend stub crashed during the stop: ...`) instead
    of only tritonserver's status 0; a stub that exits normally is not reported."""
    proc, stub, state = world
    normal = subprocess.Popen(["sh", "-c", "read line"], stdin=subprocess.PIPE)
    try:
        clean = Stub(normal.pid, stub_watch._stat(normal.pid)[19], "llm", "llm_0_1")
        state["listed"] = [stub, clean]
        state["answer"] = "UNAVAILABLE"  # unloading: died() would not count them
        watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
        assert watch.crashed_while_stopping() == []
        proc.send_signal(signal.SIGSEGV)
        normal.stdin.close()  # exits 0
        deadline = time.monotonic() + 10
        while stub.alive() or clean.alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        state["listed"] = []
        crashed = watch.crashed_while_stopping()
        assert [(s, status & 0x7F) for s, status in crashed] == [(stub, signal.SIGSEGV)]  # 0x80: a core
        assert stub_watch.describe(*crashed[0]) == f"llm_0_0 (model llm, pid {stub.pid}, killed by SIGSEGV)"
        assert watch.crashed_while_stopping() == []
    finally:
        normal.kill()
        normal.wait()


def test_a_stub_replaced_by_a_reload_between_two_looks_is_not_a_death(world):
    """vllm_backend's test_vllm_triton_backend unloads and loads models again; a plain
    Python model does both within a second, so the watch sees add_sub_0_0 gone, add_sub
    READY, and a new add_sub_0_0 running: a reload. A stub killed under its loaded model
    stays a zombie (nothing reaps it) and is a death even if a new one runs beside it."""
    proc, stub, state = world
    first = subprocess.Popen(["sleep", "60"])
    second = subprocess.Popen(["sleep", "60"])
    try:
        old = Stub(first.pid, stub_watch._stat(first.pid)[19], "add_sub", "add_sub_0_0")
        new = Stub(second.pid, stub_watch._stat(second.pid)[19], "add_sub", "add_sub_0_0")
        state["listed"] = [stub, old]
        watch = StubWatch(pgid=1, http_url="127.0.0.1:8000")
        watch.died()
        first.terminate()
        first.wait()  # reaped, as tritonserver reaps a stub it unloads
        state["listed"] = [stub, new]
        assert watch.died() == []
        proc.kill()  # killed, never reaped: a zombie
        while stub.alive():
            time.sleep(0.01)
        replacement = subprocess.Popen(["sleep", "60"])
        try:
            state["listed"] = [new, Stub(replacement.pid, stub_watch._stat(replacement.pid)[19],
                                         "llm", "llm_0_0")]
            assert watch.died() == [stub]
        finally:
            replacement.kill()
            replacement.wait()
    finally:
        for p in (first, second):
            p.kill()
            p.wait()
