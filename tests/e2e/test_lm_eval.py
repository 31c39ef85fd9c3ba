"""Issue 47: EleutherAI's lm-evaluation-harness, its own code (lm-eval 0.4.13 in
.venv-lmeval, made by scripts/setup_lmeval.sh), evaluates the OpenAI route with its
`local-completions` model and agrees with its own `hf` model on the same weights.

The served model is the embedded SmolLM2-135M as the float32 HF folder the engine converts
it to (engine/models/gguf_cache.default_model_dir); lm-eval's `hf` model loads that same
folder in float32, so both sides compute one network and may differ only by float
rounding. lm-eval sends its default token-id prompts (tokenized_requests=True) with the
tokenizer read from that folder and every hub lookup off (HF_HUB_OFFLINE): a
multiple-choice task scores each choice by the route's echoed prompt logprobs
(echo + logprobs), a generation task reads greedy completions cut at a stop string.
Tasks and data are local files written here: lm-eval's `json` dataset with `data_files`.

scripts/test.sh sets TLE_REQUIRE_LMEVAL=1, so in CI a missing venv fails these tests
instead of skipping them; TLE_LMEVAL_PYTHON points at another interpreter."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from backend.repository_layout import copy_repository
from backend.triton_server import REPO_ROOT
from tests.e2e.shared import DEFAULT_MODEL_ARGS, running_server
from tests.e2e.test_openai_frontend import running_frontend

pytestmark = pytest.mark.slow

LMEVAL_VERSION = "0.4.13"
SERVED = "smollm2-135m-f32"
# Per-item loglikelihood agreement: both sides run float32, so what is left is the order
# of float sums (our kernels against torch's), orders of magnitude below this.
LOGLIKELIHOOD_TOLERANCE = 0.05
# DEFAULT_MODEL_ARGS's dtype is "auto" (bf16 where the CPU computes it natively); the
# comparison needs float32 on both sides whatever the host.
ENGINE_ARGS = {**DEFAULT_MODEL_ARGS, "dtype": "float32"}
LMEVAL_TIMEOUT_S = 900

# Eight questions of plain fact, three or four choices each: the first choice is right.
MULTIPLE_CHOICE = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"]),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius",
                                           "100 degrees Celsius"]),
    ("The largest planet in our solar system is", ["Jupiter", "Mars", "Venus", "Mercury"]),
    ("A baby cat is called a", ["kitten", "puppy", "calf", "foal"]),
    ("The opposite of hot is", ["cold", "loud", "tall", "early"]),
    ("Two plus two equals", ["four", "five", "seven", "nine"]),
    ("Every morning the sun rises in the", ["east", "west", "north", "south"]),
    ("Bees collect nectar from flowers to make", ["honey", "milk", "wool", "glass"]),
]
GENERATION = [
    ("Q: What is the capital of France?\nA:", "Paris"),
    ("Q: What color is the sky on a clear day?\nA:", "blue"),
    ("Q: Who wrote the play Romeo and Juliet?\nA:", "Shakespeare"),
    ("Q: What do bees make?\nA:", "honey"),
]
# Short: the longer a greedy path, the likelier a near-tie somewhere parts the two sides'
# float rounding; most answers end at "\n" before this anyway.
MAX_GEN_TOKS = 16


def _lmeval_python() -> Path:
    path = Path(os.environ.get("TLE_LMEVAL_PYTHON")
                or REPO_ROOT / ".venv-lmeval" / "bin" / "python")
    if not path.exists():
        if os.environ.get("TLE_REQUIRE_LMEVAL") == "1":
            pytest.fail("TLE_REQUIRE_LMEVAL=1 but no lm-eval venv: run scripts/setup_lmeval.sh")
        pytest.skip("no lm-eval venv (scripts/setup_lmeval.sh makes .venv-lmeval)")
    return path


@pytest.fixture(scope="module")
def lmeval_python() -> Path:
    python = _lmeval_python()
    got = subprocess.run([str(python), "-c", "from importlib.metadata import version; "
                          "print(version('lm_eval'))"], capture_output=True, text=True, timeout=60)
    found = got.stdout.strip() or got.stderr[-2000:]
    assert found == LMEVAL_VERSION, f"{python} has lm_eval {found}, the test pins {LMEVAL_VERSION}"
    return python


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from engine.models.gguf_cache import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A folder for lm-eval's --include_path: two tasks over local jsonl files. The task
    files are JSON, which YAML reads as it is."""
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    mc = folder / "tle_mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": 0}) + "\n"
                          for q, c in MULTIPLE_CHOICE))
    gen = folder / "tle_gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in GENERATION))
    common = {"dataset_path": "json", "test_split": "test", "metadata": {"version": 1.0}}
    (folder / "tle_mc.yaml").write_text(json.dumps({
        "task": "tle_mc", **common, "dataset_kwargs": {"data_files": {"test": str(mc)}},
        "output_type": "multiple_choice", "doc_to_text": "{{question}}",
        "doc_to_choice": "choices", "doc_to_target": "answer",
        "metric_list": [{"metric": "acc"}]}, indent=1))
    (folder / "tle_gen.yaml").write_text(json.dumps({
        "task": "tle_gen", **common, "dataset_kwargs": {"data_files": {"test": str(gen)}},
        "output_type": "generate_until", "doc_to_text": "{{prompt}}", "doc_to_target": "target",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_GEN_TOKS, "do_sample": False},
        "metric_list": [{"metric": "exact_match"}]}, indent=1))
    return folder


class _Server:
    """What start_frontend reads of the session's Server."""

    def __init__(self, handle, model_dir: Path):
        self.handle, self.model_dir = handle, model_dir
        self.grpc, self.metrics = handle.grpc_url, handle.metrics_url


@pytest.fixture(scope="module")
def route(tmp_path_factory, lmeval_python, model_dir) -> str:
    """The route's /v1/completions over a tritonserver of its own: the session's server
    serves SmolLM2 in "auto" dtype and a random tiny model, neither of which lm-eval's
    `hf` model can be held to per item."""
    work = tmp_path_factory.mktemp("lm-eval-triton")
    repo = copy_repository(REPO_ROOT / "model_repository", work / "models", models=["llm"],
                           params={"llm": {"model": str(model_dir), **ENGINE_ARGS}})
    with running_server(repo, work, load=["llm"]) as handle:
        # start_frontend names the model tiny-llama; argparse keeps the last value given.
        with running_frontend(_Server(handle, model_dir), "--served-model-name", SERVED) as url:
            yield f"{url}/v1/completions"


def run_lm_eval(python: Path, model: str, model_args: dict[str, str], task_names: list[str],
                tasks: Path, out: Path) -> dict[str, list[dict]]:
    """lm-eval's CLI in its own venv: {task: its logged samples in doc order}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    # No hub: the model, the tokenizer and the datasets are all local, and anything that
    # still reached for the hub would fail here instead of downloading. HF_HOME keeps the
    # datasets cache of these throwaway files out of the user's.
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(out / "hf-home"), TOKENIZERS_PARALLELISM="false")
    command = [str(python), "-m", "lm_eval", "run", "--model", model,
               "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
               "--tasks", ",".join(task_names), "--include_path", str(tasks),
               "--device", "cpu", "--batch_size", "1", "--log_samples", "--output_path", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=LMEVAL_TIMEOUT_S,
                          env=env, cwd=str(out))
    assert proc.returncode == 0, \
        f"lm-eval {model} failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    samples = {}
    for name in task_names:
        files = sorted(out.glob(f"**/samples_{name}_*.jsonl"))
        assert len(files) == 1, (name, files)
        rows = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
        samples[name] = sorted(rows, key=lambda row: row["doc_id"])
    return samples


def local_completions_args(route: str, model_dir: Path) -> dict[str, str]:
    # lm-eval's defaults otherwise, token-id prompts (tokenized_requests) among them; one
    # request at a time and one retry, so a refusal fails at once instead of being retried.
    return {"model": SERVED, "base_url": route, "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface", "num_concurrent": "1", "max_retries": "1",
            "tokenized_requests": "True"}


@pytest.fixture(scope="module")
def hf_samples(tmp_path_factory, lmeval_python, model_dir, tasks) -> dict[str, list[dict]]:
    """lm-eval's own `hf` model on the same folder in float32: the reference."""
    out = tmp_path_factory.mktemp("lm-eval-hf")
    return run_lm_eval(lmeval_python, "hf", {"pretrained": str(model_dir), "dtype": "float32"},
                       ["tle_mc", "tle_gen"], tasks, out)


def test_generation_task_through_the_route_equals_lm_evals_hf_model(
        tmp_path, lmeval_python, model_dir, tasks, route, hf_samples):
    got = run_lm_eval(lmeval_python, "local-completions", local_completions_args(route, model_dir),
                      ["tle_gen"], tasks, tmp_path)["tle_gen"]
    want = hf_samples["tle_gen"]
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in want] == list(range(len(GENERATION)))
    for ours, theirs in zip(got, want):
        print(f"gen {ours['doc_id']}: route {ours['filtered_resps']!r} "
              f"hf {theirs['filtered_resps']!r}")
    assert [s["filtered_resps"] for s in got] == [s["filtered_resps"] for s in want]
    assert [s["exact_match"] for s in got] == [s["exact_match"] for s in want]
    # Greedy answers to these questions say something before their line ends: an empty
    # string on both sides would agree without showing anything.
    assert all(s["filtered_resps"][0].strip() for s in want), [s["filtered_resps"] for s in want]


def test_multiple_choice_task_through_the_route_agrees_with_lm_evals_hf_model(
        tmp_path, lmeval_python, model_dir, tasks, route, hf_samples):
    got = run_lm_eval(lmeval_python, "local-completions", local_completions_args(route, model_dir),
                      ["tle_mc"], tasks, tmp_path)["tle_mc"]
    want = hf_samples["tle_mc"]
    assert [s["doc_id"] for s in got] == [s["doc_id"] for s in want] \
        == list(range(len(MULTIPLE_CHOICE)))
    worst = 0.0
    for ours, theirs in zip(got, want):
        # filtered_resps: one [loglikelihood, is_greedy] per choice, as strings.
        ours_ll = [float(ll) for ll, _ in ours["filtered_resps"]]
        theirs_ll = [float(ll) for ll, _ in theirs["filtered_resps"]]
        assert len(ours_ll) == len(theirs_ll) == len(MULTIPLE_CHOICE[ours["doc_id"]][1])
        gaps = [abs(a - b) for a, b in zip(ours_ll, theirs_ll)]
        worst = max(worst, *gaps)
        print(f"mc {ours['doc_id']}: route {ours_ll} hf {theirs_ll} max gap {max(gaps):.2e}")
        assert max(gaps) <= LOGLIKELIHOOD_TOLERANCE, (ours["doc_id"], ours_ll, theirs_ll)
        # The choice lm-eval scores (acc): the most likely continuation.
        assert ours_ll.index(max(ours_ll)) == theirs_ll.index(max(theirs_ll)), \
            (ours["doc_id"], ours_ll, theirs_ll)
        # is_greedy: whether each continuation token was the top-1 at its place, which the
        # route's prompt top_logprobs tell lm-eval.
        assert [g for _, g in ours["filtered_resps"]] == [g for _, g in theirs["filtered_resps"]], \
            ours["doc_id"]
        assert ours["acc"] == theirs["acc"]
    print(f"largest loglikelihood gap over {len(got)} items: {worst:.2e}")
