"""The OpenAI-compatible route end to end: `python -m openai_frontend` (the command the
Kubernetes sidecar runs) in front of the session's real tritonserver, driven by the official
`openai` client. Every text is checked against what the `llm` model itself returns for the
same request over gRPC, so these tests see forwarding, not only the response's shape."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from backend.triton_server import REPO_ROOT, free_port
from tests.e2e.shared import PROMPTS
from tests.e2e.triton_clients import infer_one, llm_inputs, scrape_metrics

openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow

SERVED = "tiny-llama"
PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


def start_frontend(server, *extra_args, env=None):
    """`python -m openai_frontend` against the session's server, once healthy:
    (process, url)."""
    port = free_port()
    command = [sys.executable, "-m", "openai_frontend", "--triton-grpc", server.grpc,
               "--model", "llm", "--served-model-name", SERVED, "--triton-metrics", server.metrics,
               "--tokenizer", str(server.model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *extra_args]
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        deadline = started + 90
        while True:
            assert process.poll() is None, f"openai_frontend exited with {process.returncode}"
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "openai_frontend not healthy in 90 s"
            time.sleep(0.3)
    except BaseException:
        stop_frontend(process)
        raise
    print(f"openai_frontend healthy {time.monotonic() - started:.1f} s after start")
    return process, url


def stop_frontend(process):
    process.terminate()
    process.wait(timeout=20)


@contextmanager
def running_frontend(server, *extra_args, env=None):
    """start_frontend for a `with` block (a module fixture's life): yields the url."""
    process, url = start_frontend(server, *extra_args, env=env)
    try:
        yield url
    finally:
        stop_frontend(process)


def openai_client(url: str, api_key: str = "unused") -> "openai.OpenAI":
    """The official client on a route's /v1, no retries (a failure shows at once)."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def frontend(server):
    with running_frontend(server, "--enable-auto-tool-choice", "--tool-call-parser",
                          "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def client(frontend):
    return openai_client(frontend)


@pytest.fixture(scope="module")
def chat_prompt(server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    return tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def triton(server, prompt, **sampling):
    """The `llm` model's own answer: (texts per sequence, finish reasons, prompt tokens,
    output tokens per sequence, logprobs JSON per sequence)."""
    outcome = infer_one(server.grpc, "llm", llm_inputs(
        prompt, sampling, exclude_input_in_output=True, return_finish_reason=True,
        return_num_input_tokens=True, return_num_output_tokens=True,
        return_logprobs="logprobs" in sampling))
    assert outcome.error is None, outcome.error
    (out,) = outcome.responses
    texts = [t.decode() for t in out["text_output"]]
    logprobs = [json.loads(x) for x in out["logprobs"]] if "logprobs" in out else None
    return (texts, [r.decode() for r in out["finish_reason"]], int(out["num_input_tokens"][0]),
            [int(n) for n in out["num_output_tokens"]], logprobs)


def test_health_and_models(frontend, client):
    assert requests.get(f"{frontend}/health", timeout=5).json() == {}
    assert [m.id for m in client.models.list().data] == [SERVED]
    assert client.models.retrieve(SERVED).id == SERVED


def test_completion_is_the_models_greedy_text(server, client):
    texts, reasons, prompt_tokens, output_tokens, _ = triton(server, PROMPT, temperature=0, max_tokens=12)
    got = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0)
    assert [c.text for c in got.choices] == texts
    assert got.choices[0].finish_reason == reasons[0] == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_tokens, output_tokens[0])
    assert got.usage.total_tokens == prompt_tokens + 12 and got.model == SERVED


def test_completion_stream_with_usage(server, client):
    texts, _, prompt_tokens, _, _ = triton(server, PROMPT, temperature=0, max_tokens=12)
    chunks = list(client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (prompt_tokens, 12)


def test_chat_applies_the_template(server, client, chat_prompt):
    texts, _, prompt_tokens, output_tokens, _ = triton(server, chat_prompt, temperature=0, max_tokens=10)
    got = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_completion_tokens=10,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == texts[0]
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (prompt_tokens, output_tokens[0])
    stream = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == texts[0]
    assert stream[-1].usage.prompt_tokens == prompt_tokens


def test_n2_with_seed_and_stop(server, client):
    texts, _, _, _, _ = triton(server, PROMPT, temperature=1.0, seed=11, n=2, max_tokens=8)
    got = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                    seed=11, n=2)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == texts
    # A stop string from inside the greedy text cuts it there, with finish_reason stop.
    full, _, _, _, _ = triton(server, PROMPT, temperature=0, max_tokens=12)
    stop = full[0][len(full[0]) // 2:len(full[0]) // 2 + 3]
    expected, reasons, _, _, _ = triton(server, PROMPT, temperature=0, max_tokens=12, stop=[stop])
    got = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].text == expected[0] and stop not in expected[0]
    assert got.choices[0].finish_reason == reasons[0] == "stop"


def test_logprobs(server, client, chat_prompt):
    texts, _, _, _, logprobs = triton(server, PROMPT, temperature=0, max_tokens=5, logprobs=2)
    got = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == texts[0]
    assert lp.token_logprobs == pytest.approx([next(iter(p.values()))["logprob"] for p in logprobs[0]])
    assert all(len(top) == 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    _, _, _, _, chat_lps = triton(server, chat_prompt, temperature=0, max_tokens=5, logprobs=3)
    got = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [next(iter(p.values()))["logprob"] for p in chat_lps[0]])
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob
               for c in content)


def test_response_format(server, client, chat_prompt):
    texts, _, _, _, _ = triton(server, chat_prompt, temperature=0, max_tokens=40,
                               structured_outputs={"json": SCHEMA})
    got = client.chat.completions.create(
        model=SERVED, messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert got.choices[0].message.content == texts[0]
    assert got.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(texts[0])["a"], int)
    texts, reasons, _, _, _ = triton(server, PROMPT, temperature=0, max_tokens=40,
                                     structured_outputs={"json_object": True})
    # response_format is a chat parameter in OpenAI's API; on completions it is vLLM's
    # extension, which the openai client sends through extra_body.
    got = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert got.choices[0].text == texts[0] and got.choices[0].finish_reason == reasons[0]
    if reasons[0] == "stop":
        assert isinstance(json.loads(texts[0]), dict)


def test_errors_are_openai_errors_and_the_service_stays_up(frontend, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=SERVED, prompt=PROMPT, temperature=-1)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    assert "temperature" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError):  # refused before the stream starts
        client.chat.completions.create(model=SERVED, messages=MESSAGES, stream=True, top_p=5)
    # An unknown field is ignored (as vLLM), so the request runs with the known ones.
    ignored = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3,
                                        extra_body={"max_token": 1, "x_agent_trace": {"id": 1}})
    assert ignored.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as bad:  # the engine's max_logprobs is 20
        client.completions.create(model=SERVED, prompt=PROMPT, logprobs=50)
    assert bad.value.param == "logprobs"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert missing.value.code == "model_not_found"
    r = requests.post(f"{frontend}/v1/completions", data="{not json", timeout=10,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert requests.get(f"{frontend}/health", timeout=5).status_code == 200
    assert client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_concurrent_requests_each_get_their_own_text(server, client):
    expected = [triton(server, p, temperature=0, max_tokens=10)[0][0] for p in PROMPTS]

    def ask(i):  # every other request streamed
        if i % 2:
            return client.completions.create(model=SERVED, prompt=PROMPTS[i], max_tokens=10,
                                             temperature=0).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(
            model=SERVED, prompt=PROMPTS[i], max_tokens=10, temperature=0, stream=True))

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(ask, range(len(PROMPTS)))) == expected


def test_client_disconnect_cancels_the_triton_request(server, frontend):
    def llm_metric(name):
        # Triton adds an `instance` label, so the labels are matched one by one.
        return sum(v for k, v in scrape_metrics(server.metrics).items()
                   if k.startswith(name + "{") and 'model="llm"' in k)

    before = llm_metric("vllm:generation_tokens_total")
    body = {"model": SERVED, "prompt": "Hello", "n": 16, "max_tokens": 480, "min_tokens": 480,
            "temperature": 1.0, "stream": True}
    with requests.post(f"{frontend}/v1/completions", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 4:
                break
    deadline = time.monotonic() + 20
    while llm_metric("vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "the request kept running after the client left"
        time.sleep(0.2)
    # All 16 sequences to the end would be 7,680 tokens.
    assert llm_metric("vllm:generation_tokens_total") - before < 16 * 480 / 2


# ---- tools, /metrics, /tokenize, --api-key ---------------------------------------------

# Bounded values, so the random tiny model's constrained output ends within max_tokens.
WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                            "rain": {"type": "boolean"}},
           "required": ["unit", "rain"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
             "additionalProperties": False}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def tools_prompt(server):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    return tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False,
                                         add_generation_prompt=True)


def streamed_calls(chunks):
    """The tool calls of a stream, put together as the client's deltas say."""
    calls = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or delta.id
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)]


def test_named_tool_choice_calls_that_function(server, client, tools_prompt):
    import jsonschema

    texts, reasons, _, _, _ = triton(server, tools_prompt, temperature=0, max_tokens=60,
                                     structured_outputs={"json": WEATHER})
    got = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS,
                                         tool_choice=NAMED, max_tokens=60, temperature=0)
    choice = got.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("chatcmpl-tool-") and choice.message.content == ""
    assert call.function.arguments == texts[0]  # the constrained text is the arguments
    assert choice.finish_reason == reasons[0] == "stop"  # vLLM: a named call stops with "stop"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice=NAMED, max_tokens=60, temperature=0,
                                                 stream=True))
    (streamed,) = streamed_calls(stream)
    assert (streamed["name"], streamed["arguments"]) == ("get_weather", texts[0])
    assert streamed["id"].startswith("chatcmpl-tool-")
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "stop"


def test_required_tool_choice_gives_tool_calls(server, client, tools_prompt):
    import jsonschema

    from openai_frontend.tool_calls import required_schema

    schema = required_schema(TOOLS, parallel_tool_calls=False)
    texts, reasons, _, _, _ = triton(server, tools_prompt, temperature=0, max_tokens=80,
                                     structured_outputs={"json": schema})
    assert reasons[0] == "stop", texts
    expected = json.loads(texts[0])
    got = client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=80, temperature=0)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"  # vLLM: "required" that stopped
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] \
        == [(e["name"], e["parameters"]) for e in expected]
    for call in choice.message.tool_calls:
        parameters = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    stream = list(client.chat.completions.create(model=SERVED, messages=MESSAGES, tools=TOOLS,
                                                 tool_choice="required", parallel_tool_calls=False,
                                                 max_tokens=80, temperature=0, stream=True))
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls(stream)] \
        == [(e["name"], e["parameters"]) for e in expected]
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "tool_calls"


def test_auto_tool_choice_parses_hermes_calls(server, client, tools_prompt):
    # The random tiny model writes hermes' format only when made to: a regex constraint
    # (structured outputs stay allowed with tool_choice auto, as in vLLM).
    regex = r'Ok\. <tool_call>\{"name": "get_time", "arguments": \{"utc": (true|false)\}\}</tool_call>'
    texts, reasons, _, _, _ = triton(server, tools_prompt, temperature=0, max_tokens=60,
                                     skip_special_tokens=False, structured_outputs={"regex": regex})
    assert reasons[0] == "stop", texts
    kwargs = dict(model=SERVED, messages=MESSAGES, tools=TOOLS, max_tokens=60, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Ok. "
    (call,) = choice.message.tool_calls
    arguments = texts[0].split('"arguments": ')[1].removesuffix("}</tool_call>")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", json.loads(arguments))
    stream = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "Ok. "
    (streamed,) = streamed_calls(stream)
    assert (streamed["name"], json.loads(streamed["arguments"])) == ("get_time", json.loads(arguments))
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "tool_calls"


def test_metrics_on_the_routes_port_are_tritons(server, frontend):
    ours = requests.get(f"{frontend}/metrics", timeout=10)
    assert ours.status_code == 200 and ours.headers["content-type"].startswith("text/plain")
    families = {line.split()[2] for line in ours.text.splitlines() if line.startswith("# TYPE ")}
    theirs = requests.get(server.metrics, timeout=10).text
    tritons = {line.split()[2] for line in theirs.splitlines() if line.startswith("# TYPE ")}
    # Triton's text first, then the route's own counters.
    assert tritons <= families and all(f.startswith("openai_frontend:") for f in families - tritons)
    assert ours.text.index("vllm:num_requests_running") < ours.text.index("openai_frontend:")
    assert "vllm:num_requests_running" in families


def test_tokenize_counts_what_the_llm_model_counts(server, frontend):
    _, _, prompt_tokens, _, _ = triton(server, PROMPT, temperature=0, max_tokens=1)
    r = requests.post(f"{frontend}/tokenize", json={"model": SERVED, "prompt": PROMPT}, timeout=10).json()
    assert r["count"] == len(r["tokens"]) == prompt_tokens
    assert r["max_model_len"] == 512  # the `llm` model's config parameter
    back = requests.post(f"{frontend}/detokenize", json={"tokens": r["tokens"]}, timeout=10).json()
    assert PROMPT in back["prompt"]
    assert requests.get(f"{frontend}/version", timeout=10).json() == {"version": "0.1.0"}


def test_api_key_from_the_env_var(server):
    import os

    process, url = start_frontend(server, env={**os.environ, "VLLM_API_KEY": "s3cret"})
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert keyed.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert requests.get(f"{url}/health", timeout=5).status_code == 200  # not guarded, as vLLM
    finally:
        stop_frontend(process)
