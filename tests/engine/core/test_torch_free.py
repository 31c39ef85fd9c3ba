"""engine.core and engine.output import and schedule without torch: in a child process where
`import torch` fails (this session imported torch long ago, in conftest.py), every module
of both packages is imported, the top-level scheduling names are taken from `engine`, and
one request is scheduled and given a token. engine.api, the surface backend/ and tuning/
import, holds every public name but the lazy ones (LLM, LLMEngine, model files) there too."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]

NO_TORCH = """
import sys
sys.modules["torch"] = None  # `import torch` (and torch.anything) now raises ImportError
"""

IMPORT_ALL = NO_TORCH + """
import importlib, pkgutil
import engine.core, engine.output
names = {"engine.core", "engine.output"}
for package in (engine.core, engine.output):
    names |= {m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")}
expected = {"engine.core.scheduler", "engine.core.kv_cache", "engine.core.kv_cache.block_pool",
            "engine.core.kv_cache.manager", "engine.core.stop_checker", "engine.output.detokenizer",
            "engine.output.stop_strings", "engine.output.parallel_sampling"}
assert expected <= names, expected - names
for name in sorted(names):
    importlib.import_module(name)

from engine import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
import engine.api
eager = set(engine.api.__all__) - set(engine.api._LAZY)
assert eager and eager <= set(vars(engine.api)), eager - set(vars(engine.api))

scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(num_kv_blocks=8, block_size=4))
scheduler.add_request(Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2)))
out = scheduler.schedule()
assert isinstance(out, SchedulerOutput) and out.num_scheduled_tokens == {"r": 5}, out
scheduler.update_from_output(out, {"r": [7]})
assert scheduler.requests["r"].output_token_ids == [7]
assert sys.modules["torch"] is None and not [m for m in sys.modules if m.startswith("torch.")]
print(len(names), "modules")
"""


def run_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_scheduling_and_output_handling_import_and_run_without_torch():
    out = run_child(IMPORT_ALL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("modules")


@pytest.mark.parametrize("module", ["engine.sample.sampler", "engine.llm_engine"])
def test_the_child_does_fail_on_a_module_that_imports_torch(module):
    out = run_child(NO_TORCH + f"import {module}\n")
    assert out.returncode != 0 and "torch" in out.stderr.splitlines()[-1], out.stderr[-3000:]
