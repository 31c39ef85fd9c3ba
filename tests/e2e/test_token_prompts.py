"""Issue 47 against the session's real tritonserver: prompts as token ids through the
`llm` model (gRPC) and through the OpenAI route, bad ids refused alone, /tokenize's
max_model_len equal to the limit the model enforces, usage's cached_tokens, and
/tokenizer_info in vLLM's shape (read by vLLM's own code)."""
from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from tests.e2e.shared import PROMPTS, TINY_ENGINE_ARGS
from tests.e2e.test_openai_frontend import SERVED, openai_client, running_frontend, triton

openai = pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[test]')")

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = int(TINY_ENGINE_ARGS["max_model_len"])
_TYPES = {np.dtype(np.object_): "BYTES", np.dtype(np.bool_): "BOOL",
          np.dtype(np.int64): "INT64", np.dtype(np.int32): "INT32"}


def llm(url: str, tensors: dict[str, np.ndarray], model: str = "llm", timeout: float = 120.0):
    """One `llm` request on its own stream: (outputs of its one response, None) or (None,
    the error)."""
    inputs = []
    for name, array in tensors.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _TYPES[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    answers: queue.SimpleQueue = queue.SimpleQueue()

    def callback(result, error):
        if error is not None:
            answers.put((None, str(error)))
        elif result.get_response().outputs:
            answers.put(({o.name: result.as_numpy(o.name) for o in result.get_response().outputs},
                         None))

    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=callback)
    try:
        client.async_stream_infer(model, inputs, request_id="0")
        return answers.get(timeout=timeout)
    finally:
        client.stop_stream()
        client.close()


def greedy_inputs(prompt: str | list[int], max_tokens: int = 12, **flags) -> dict[str, np.ndarray]:
    """A greedy request whose logprobs name each sampled id (the sampled token first)."""
    tensors = ({"text_input": np.array([prompt.encode()], dtype=np.object_)} if isinstance(prompt, str)
               else {"prompt_token_ids": np.array(prompt, dtype=np.int64)})
    sampling = {"temperature": 0, "max_tokens": max_tokens, "logprobs": 0}
    tensors["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    for name, value in {"return_logprobs": True, "return_num_input_tokens": True,
                        "exclude_input_in_output": True, **flags}.items():
        tensors[name] = np.array([value])
    return tensors


def sampled_ids(outputs) -> list[int]:
    return [int(next(iter(position))) for position in json.loads(outputs["logprobs"][0])]


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.model_dir)


@pytest.fixture(scope="module")
def vocab_size(server) -> int:
    """The tiny model's embedding rows, the bound the engine checks ids against."""
    return json.loads((server.model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def frontend(server):
    with running_frontend(server, "--enable-tokenizer-info-endpoint") as url:
        yield url


@pytest.fixture(scope="module")
def client(frontend):
    return openai_client(frontend)


def test_an_id_prompt_samples_the_same_tokens_as_its_text(server, tokenizer):
    for text in PROMPTS[:3]:
        ids = tokenizer.encode(text)  # as the `llm` model tokenizes a text_input
        by_text, error = llm(server.grpc, greedy_inputs(text))
        assert error is None, error
        by_ids, error = llm(server.grpc, greedy_inputs(ids))
        assert error is None, error
        assert sampled_ids(by_ids) == sampled_ids(by_text) and len(sampled_ids(by_ids)) == 12
        assert by_ids["text_output"][0] == by_text["text_output"][0]
        assert int(by_ids["num_input_tokens"][0]) == len(ids)
    # exclude_input_in_output false: the ids decoded (special tokens kept) before the text.
    ids = [tokenizer.bos_token_id, *tokenizer.encode(PROMPTS[0])]
    whole, error = llm(server.grpc, greedy_inputs(ids, exclude_input_in_output=False))
    alone, _ = llm(server.grpc, greedy_inputs(ids))
    assert error is None, error
    assert whole["text_output"][0].decode() == tokenizer.decode(ids) + alone["text_output"][0].decode()


def test_bad_id_prompts_are_invalid_arg_and_a_request_beside_them_is_unaffected(server, tokenizer,
                                                                              vocab_size):
    good = greedy_inputs(PROMPTS[3], max_tokens=24)
    expected, error = llm(server.grpc, good)
    assert error is None, error
    text = {"text_input": np.array([b"hi"], dtype=np.object_)}
    bad = {
        "past the vocabulary": ({"prompt_token_ids": np.array([5, vocab_size], np.int64)},
                                ["prompt_token_ids", f"[0, {vocab_size})", f"[{vocab_size}]"]),
        "negative": ({"prompt_token_ids": np.array([-3, 5], np.int64)}, ["prompt_token_ids", "[-3]"]),
        "empty": ({"prompt_token_ids": np.zeros(0, np.int64)}, ["prompt_token_ids must not be empty"]),
        "both": ({**text, "prompt_token_ids": np.array([5], np.int64)}, ["not both"]),
        "neither": ({"stream": np.array([False])}, ["text_input", "prompt_token_ids"]),
        # Triton's own check of the config's INT64.
        "INT32": ({"prompt_token_ids": np.array([5, 6], np.int32)}, ["prompt_token_ids", "INT64"]),
        "max_model_len ids": ({"prompt_token_ids": np.full(MAX_MODEL_LEN, 5, np.int64)},
                              [f"is {MAX_MODEL_LEN} ids long", f"max_model_len={MAX_MODEL_LEN}"]),
    }
    with ThreadPoolExecutor(len(bad) + 1) as pool:
        running = pool.submit(llm, server.grpc, good)
        refusals = {case: pool.submit(llm, server.grpc, tensors) for case, (tensors, _) in bad.items()}
        beside, error = running.result()
    assert error is None, error
    assert sampled_ids(beside) == sampled_ids(expected)
    for case, (_, fragments) in bad.items():
        outputs, error = refusals[case].result()
        assert outputs is None and error, case
        assert all(f in error for f in fragments), (case, error)


def test_http_generate_takes_prompt_token_ids_and_refuses_bad_ones_as_invalid_arg(
        server, tokenizer, vocab_size):
    """Triton's generate endpoint maps a JSON list onto the INT64 input; INVALID_ARG is
    its 400. Not streaming, the decoded prompt comes first (vllm_backend's default)."""
    ids = tokenizer.encode(PROMPTS[0])
    by_grpc, _ = llm(server.grpc, greedy_inputs(ids, max_tokens=6))
    url = f"{server.http}/v2/models/llm/generate"
    params = {"max_tokens": 6, "temperature": 0}
    r = requests.post(url, json={"prompt_token_ids": ids, "parameters": params}, timeout=60)
    expected = tokenizer.decode(ids) + by_grpc["text_output"][0].decode()
    assert r.status_code == 200 and r.json()["text_output"] == expected, r.text
    for bad in ([ids[0], vocab_size], [-1], []):
        r = requests.post(url, json={"prompt_token_ids": bad, "parameters": params}, timeout=60)
        assert r.status_code == 400 and "prompt_token_ids" in r.json()["error"], (bad, r.text)


def test_the_model_answers_its_own_max_model_len_and_enforces_it(server):
    """A request holding only return_max_model_len is answered at once; the figure is the
    engine's resolved limit (llm_default runs with another) and the one it enforces."""
    ask = {"return_max_model_len": np.array([True])}
    for model, expected in (("llm", MAX_MODEL_LEN), ("llm_default", 1024)):
        outputs, error = llm(server.grpc, ask, model=model)
        assert error is None, error
        assert set(outputs) == {"max_model_len"} and int(outputs["max_model_len"][0]) == expected


def test_completions_take_an_id_prompt_and_a_batch_of_them(server, client, tokenizer):
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]
    singles = []
    for ids, text in zip(prompts, PROMPTS):
        texts, _, prompt_tokens, _, _ = triton(server, text, temperature=0, max_tokens=10)
        got = client.completions.create(model=SERVED, prompt=ids, max_tokens=10, temperature=0)
        assert [c.text for c in got.choices] == texts
        assert got.usage.prompt_tokens == prompt_tokens == len(ids)
        singles.append(texts[0])
    batch = client.completions.create(model=SERVED, prompt=prompts, max_tokens=10, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == singles
    assert batch.usage.prompt_tokens == sum(map(len, prompts))
    # echo: the id prompt as /detokenize decodes it.
    echoed = client.completions.create(model=SERVED, prompt=prompts[0], max_tokens=10,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == tokenizer.decode(prompts[0]) + singles[0]
    stream = list(client.completions.create(model=SERVED, prompt=prompts[1], max_tokens=10,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == singles[1]


@pytest.mark.parametrize("prompt,fragment", [([1, "a"], "not a mix"), ([[3], []], "prompt[1]"),
                                             ([4, -1], "non-negative"), ([], "empty"),
                                             ("vocab", "[0, ")])
def test_bad_id_prompts_are_400_naming_prompt(frontend, vocab_size, prompt, fragment):
    prompt = [7, vocab_size] if prompt == "vocab" else prompt  # refused by the `llm` model
    r = requests.post(f"{frontend}/v1/completions", timeout=60,
                      json={"model": SERVED, "prompt": prompt, "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt" and fragment in error["message"], r.text


def test_tokenize_reports_the_max_model_len_the_model_enforces(frontend, client):
    r = requests.post(f"{frontend}/tokenize", json={"model": SERVED, "prompt": "Hi"}, timeout=30)
    limit = r.json()["max_model_len"]
    assert limit == MAX_MODEL_LEN
    fits = client.completions.create(model=SERVED, prompt=[5] * (limit - 1), max_tokens=1)
    assert fits.usage.prompt_tokens == limit - 1 and fits.usage.completion_tokens == 1
    for length in (limit, limit + 1):
        with pytest.raises(openai.BadRequestError, match=f"max_model_len={limit}"):
            client.completions.create(model=SERVED, prompt=[5] * length, max_tokens=1)
    # A text prompt meets the same limit in the engine.
    with pytest.raises(openai.BadRequestError, match=f"max_model_len={limit}"):
        client.completions.create(model=SERVED, prompt="hello " * limit, max_tokens=1)


def test_usage_reports_cached_tokens_of_a_repeated_prompt(client):
    # Ids no other test sends, three 16-token blocks long: the second request finds the
    # first's full blocks in the prefix cache.
    prompt = [int(t) for t in np.random.default_rng(47).integers(100, 40000, 50)]
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 48
    stream = list(client.completions.create(model=SERVED, prompt=prompt, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == 48


def test_tokenizer_info_is_what_vllm_serves(server, frontend, tokenizer, vllm_side):
    info = requests.get(f"{frontend}/tokenizer_info", timeout=30).json()
    theirs = vllm_side.run(VLLM_TOKENIZER_INFO, {"folder": str(server.model_dir), "ours": info})
    # vLLM's response model takes ours (tokenizer_class required, extra fields kept).
    assert theirs["validated"] == info
    # The fields both transformers versions hold agree; vLLM names its cached wrapper
    # class, ours the transformers class AutoTokenizer loads.
    shared = set(theirs["info"]) & set(info) - {"tokenizer_class"}
    assert {"bos_token", "eos_token", "unk_token", "chat_template", "model_max_length"} <= shared
    assert {k: info[k] for k in shared} == {k: theirs["info"][k] for k in shared}
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert "name_or_path" not in info  # a path on the server's host


VLLM_TOKENIZER_INFO = """
import json, sys
from vllm.entrypoints.serve.tokenize.protocol import TokenizerInfoResponse
from vllm.entrypoints.serve.tokenize.serving import TokenizerInfo
from vllm.tokenizers import get_tokenizer

payload = json.load(sys.stdin)
info = TokenizerInfo(get_tokenizer(payload["folder"]), None).to_dict()
validated = TokenizerInfoResponse(**payload["ours"]).model_dump()
print(json.dumps({"info": info, "validated": validated}, default=repr))
"""
