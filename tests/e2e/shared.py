"""Constants and helpers shared by the e2e tests and their server fixture."""
from __future__ import annotations

import contextlib
import time

# Engine arguments shared by the served models and the in-process references, so
# greedy outputs must match token for token. fp32 keeps batched and single-sequence
# numerics close enough that greedy argmax never flips on the random weights.
TINY_ENGINE_ARGS = {"dtype": "float32", "block_size": "16", "num_kv_blocks": "256",
                    "max_num_seqs": "64", "max_model_len": "512", "max_num_batched_tokens": "1024"}
DEFAULT_MODEL_ARGS = {"dtype": "auto", "block_size": "16", "num_kv_blocks": "128",
                      "max_num_seqs": "8", "max_model_len": "1024"}
# The faulty copy fails its 16th step: late enough that three requests sent together
# have all arrived, with one of them WAITING behind FAULTY_MAX_NUM_SEQS running ones.
FAILURE_STEP = 16
FAULTY_MAX_NUM_SEQS = 2


PROMPTS = ["Hello, my name is", "The capital of France is", "Écrire un poème sur la mer:",
           "def fibonacci(n):", "日本の首都は", "1, 2, 3, 4,", "Once upon a time", "Q: 2+2=? A:"]


def greedy(max_tokens: int, **extra):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


@contextlib.contextmanager
def running_server(repo, work, load=(), timeout: float = 420):
    """A real tritonserver on `repo` in explicit model-control mode (each test loads what
    it needs, and a model that fails to load leaves the others up), stopped on exit."""
    from backend.triton_server import ServerPorts, TritonServer

    handle = TritonServer(repo, ServerPorts.free(), log_path=work / "tritonserver.log",
                          extra_args=["--model-control-mode=explicit", "--exit-timeout-secs=15",
                                      *[f"--load-model={name}" for name in load]])
    handle.start()
    try:
        handle.wait_ready(timeout=timeout)
        yield handle
    finally:
        handle.stop()


@contextlib.contextmanager
def loaded(client, name: str):
    """Model `name` loaded on an explicit-mode server for the block, unloaded after. The
    unload is awaited: Triton returns from unload_model before the stub has gone, and a
    load begun while another model's stub was still shutting down once hung for the
    whole test timeout (tritonserver 2.51)."""
    client.load_model(name)
    try:
        yield
    finally:
        client.unload_model(name)
        wait_unloaded(client, name)


def wait_unloaded(client, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = {m.name: m.state for m in client.get_model_repository_index().models}
        if states.get(name) not in ("READY", "UNLOADING", "LOADING"):
            return
        time.sleep(0.1)
    raise AssertionError(f"model {name!r} still {states.get(name)} {timeout:.0f} s after unload")


def assert_loads_fail(client, fragments_by_model: dict[str, list[str]]) -> None:
    """Each model fails to load with every fragment in the error, is not ready after, and
    the server stays live."""
    from tritonclient.utils import InferenceServerException

    import pytest

    for name, fragments in fragments_by_model.items():
        with pytest.raises(InferenceServerException) as failure:
            client.load_model(name)
        assert all(f in str(failure.value) for f in fragments), str(failure.value)
        assert not client.is_model_ready(name)
    assert client.is_server_live()
