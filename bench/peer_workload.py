"""The token-id workload file bench_generate hands its peers (vllm_peer.py,
llamacpp_peer.py): {"prompts": [[token ids], ...], "max_tokens": [n, ...]}. Standard
library only: the peers run in their own venvs, as files, so this sits on their path."""
import json


def read_workload(path: str) -> tuple[list[list[int]], list[int]]:
    with open(path) as f:
        wl = json.load(f)
    prompts = [list(map(int, p)) for p in wl["prompts"]]
    max_tokens = [int(n) for n in wl["max_tokens"]]
    assert len(prompts) == len(max_tokens), "prompts/max_tokens length mismatch"
    return prompts, max_tokens
