"""Our block hashes against vLLM 0.32's own: for each of its `prefix_caching_hash_algo`
values, vLLM's request block hasher (vllm/v1/core/kv_cache_utils.py:
get_request_block_hasher -> generate_block_hash_extra_keys -> hash_block_tokens, with the
functions of vllm/utils/hashing.py:get_hash_fn_by_name and the first parent from
init_none_hash) hashes the same tokens, salted and not, and must give our chain byte for
byte; so must the extra keys vLLM publishes in BlockStored (to_event_extra_keys).

The first block's parent (NONE_HASH): with PYTHONHASHSEED set, vLLM hashes that string
with every algorithm, and so do we. Unset, vLLM hashes its fixed seed string for the
SHA-256 algorithms (we match) and 32 random bytes per process for the xxhash ones, which
no other process can match: neither can we, nor does one vLLM process match another; the
test checks that both sides are random there rather than equal."""
import pytest

from engine.core.kv_cache.hashing import BlockHasher, event_extra_keys

VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
BLOCK_SIZE = 16

# Runs under vLLM's interpreter: a vLLM Request per case, hashed by vLLM's own block
# hasher; prints every chain (hex), vLLM's NONE_HASH and its event extra keys.
VLLM_HASHES = r"""
import json, sys
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as kcu
from vllm.v1.request import Request

cases = json.load(sys.stdin)
out = []
for case in cases:
    fn = get_hash_fn_by_name(case["algo"])
    kcu.init_none_hash(fn)
    hasher = kcu.get_request_block_hasher(case["block_size"], fn)
    lora = None if case["lora"] is None else LoRARequest(*case["lora"])
    request = Request(request_id="r", prompt_token_ids=case["tokens"],
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      cache_salt=case["salt"], block_hasher=hasher, lora_request=lora)
    hashes = list(request.block_hashes)
    bs = case["block_size"]
    extra = [kcu.generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, 0)[0]
             for i in range(len(hashes))]
    # And hash_block_tokens called directly on an explicit parent chain.
    direct, parent = [], None
    for i, keys in enumerate(extra):
        parent = kcu.hash_block_tokens(fn, parent, case["tokens"][i * bs:(i + 1) * bs], keys)
        direct.append(parent)
    out.append({"hashes": [h.hex() for h in hashes], "direct": [h.hex() for h in direct],
                "none_hash": kcu.NONE_HASH.hex(),
                "none_hash_of_default_seed": fn(kcu.DEFAULT_NONE_HASH_SEED).hex(),
                "extra_keys": [None if k is None else [list(x) for x in k] for k in extra],
                "event_extra_keys": [None if k is None else list(k)
                                     for k in (kcu.to_event_extra_keys(extra) or [])]})
print(json.dumps(out))
"""


def _cases(loras=(None,)):
    tokens = [(i * 7919) % 49152 for i in range(5 * BLOCK_SIZE + 3)]  # 5 full blocks + 3
    return [{"algo": algo, "tokens": tokens, "block_size": BLOCK_SIZE, "salt": salt,
             "lora": lora}
            for algo in VLLM_ALGOS for salt in (None, "tenant-a") for lora in loras]


def _ours(case):
    hasher = BlockHasher(case["algo"])
    lora = case["lora"]
    # vLLM's LoRARequest(lora_name, lora_int_id, lora_path) as the engine's
    # lora_extra_key sees it.
    lora_key = None if lora is None else ("lora", lora[0], lora[2])
    chain = hasher.chain(case["tokens"], case["block_size"], case["salt"], lora_key=lora_key)
    return {"hashes": [h.hex() for h in chain], "none_hash": hasher.none_hash.hex(),
            "event_extra_keys": [None if k is None else list(k)
                                 for k in (event_extra_keys(case["salt"], i, lora_key)
                                           for i in range(len(chain)))]}


def test_block_hashes_equal_vllms_with_pythonhashseed(vllm_side, monkeypatch):
    """PYTHONHASHSEED set alike on both sides: every algorithm's chain, salted or not, is
    vLLM's, first block included."""
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    cases = _cases()
    theirs = vllm_side.run(VLLM_HASHES, cases, env={"PYTHONHASHSEED": "1234"})
    for case, vllm in zip(cases, theirs):
        ours = _ours(case)
        label = f"{case['algo']} salt={case['salt']}"
        assert vllm["hashes"] == vllm["direct"], label  # vLLM's two paths agree
        assert len(ours["hashes"]) == 5, label
        assert ours["none_hash"] == vllm["none_hash"], label
        assert ours["hashes"] == vllm["hashes"], label
        # The salt enters the hash tagged, the event bare, on the first block only.
        expected_keys = [[["cache_salt", case["salt"]]]] + [None] * 4 if case["salt"] else [None] * 5
        assert vllm["extra_keys"] == expected_keys, label
        assert ours["event_extra_keys"] == vllm["event_extra_keys"], label
    salted = {c["algo"]: o["hashes"] for c, o in zip(cases, theirs) if c["salt"]}
    plain = {c["algo"]: o["hashes"] for c, o in zip(cases, theirs) if not c["salt"]}
    assert all(salted[a][0] != plain[a][0] for a in VLLM_ALGOS)


def test_adapter_blocks_hash_as_vllms(vllm_side, monkeypatch):
    """A LoRA request's blocks: vLLM hashes ("lora", name, path) into every block (before
    the salt) and publishes the bare name; our chain and event keys are vLLM's, byte for
    byte. Two adapters, or one name at two folders, never share a hash, nor with the base."""
    monkeypatch.setenv("PYTHONHASHSEED", "99")
    loras = (None, ["alpha", 1, "/adapters/alpha"], ["beta", 2, "/adapters/beta"],
             ["alpha", 3, "/adapters/alpha-v2"])
    cases = [c for c in _cases(loras) if c["algo"] in ("sha256_cbor", "xxhash")]
    theirs = vllm_side.run(VLLM_HASHES, cases, env={"PYTHONHASHSEED": "99"})
    firsts = {}
    for case, vllm in zip(cases, theirs):
        ours = _ours(case)
        label = f"{case['algo']} salt={case['salt']} lora={case['lora']}"
        assert ours["hashes"] == vllm["hashes"] == vllm["direct"], label
        assert ours["event_extra_keys"] == vllm["event_extra_keys"], label
        if case["lora"] is not None:
            lora_key = ["lora", case["lora"][0], case["lora"][2]]
            salt_key = [["cache_salt", case["salt"]]] if case["salt"] else []
            assert vllm["extra_keys"] == [[lora_key, *salt_key]] + [[lora_key]] * 4, label
            name = case["lora"][0]
            assert vllm["event_extra_keys"] == [[name, *([case["salt"]] if case["salt"] else [])]] \
                + [[name]] * 4, label
        firsts.setdefault((case["algo"], case["salt"]), set()).add(vllm["hashes"][0])
    assert all(len(hashes) == len(loras) for hashes in firsts.values())


def test_first_parent_without_pythonhashseed_is_vllms_rule(vllm_side, monkeypatch):
    """PYTHONHASHSEED unset: SHA-256 chains equal vLLM's (its fixed seed string); xxhash
    chains are seeded at random on both sides, so they equal nothing outside the process,
    vLLM's included, exactly as vLLM's own do not."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cases = [c for c in _cases() if c["salt"] is None]
    theirs = vllm_side.run(VLLM_HASHES, cases)
    for case, vllm in zip(cases, theirs):
        ours = _ours(case)
        if case["algo"].startswith("sha256"):
            assert vllm["none_hash"] == vllm["none_hash_of_default_seed"]
            assert ours["none_hash"] == vllm["none_hash"], case["algo"]
            assert ours["hashes"] == vllm["hashes"], case["algo"]
        else:
            assert vllm["none_hash"] != vllm["none_hash_of_default_seed"], case["algo"]
            assert ours["none_hash"] not in (vllm["none_hash"], vllm["none_hash_of_default_seed"])
            assert ours["hashes"][0] != vllm["hashes"][0]


@pytest.mark.parametrize("algo", VLLM_ALGOS)
def test_ours_chain_is_resumable_from_any_block(algo, monkeypatch):
    """What the engine does as a request grows (update_block_hashes): continuing the chain
    from block k's hash gives the same hashes as hashing from the start."""
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    case = _cases()[VLLM_ALGOS.index(algo) * 2 + 1]
    hasher = BlockHasher(algo)
    whole = hasher.chain(case["tokens"], BLOCK_SIZE, case["salt"])
    for k in range(1, len(whole)):
        assert hasher.chain(case["tokens"], BLOCK_SIZE, case["salt"], start=k,
                            parent_hash=whole[k - 1]) == whole[k:]
