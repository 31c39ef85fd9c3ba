"""max_loras as vLLM's scheduler applies it: at most that many distinct adapters among
the running requests; a waiting request whose adapter would make one too many is passed
over, keeping its place, while requests for running adapters and the base still start."""
from engine.config import CacheConfig, LoRAConfig, SchedulerConfig
from engine.core.kv_cache.hashing import BlockHasher, update_block_hashes
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.lora.request import LoRARequest
from engine.sampling_params import SamplingParams
from testing.sched_invariants import check_state

ADAPTERS = {name: LoRARequest(name, i + 1, f"/adapters/{name}") for i, name in enumerate("abc")}


def make(max_loras=1, enable=True, **sched):
    sched.setdefault("max_model_len", 512)
    return Scheduler(SchedulerConfig(**sched), CacheConfig(num_kv_blocks=200, block_size=16),
                     lora_config=LoRAConfig(enable_lora=enable, max_loras=max_loras,
                                            max_cpu_loras=3))


def req(rid, adapter, n=20, max_tokens=4):
    return Request(rid, [(hash(rid) + i) % 30000 + 1 for i in range(n)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   lora_request=None if adapter is None else ADAPTERS[adapter])


def run_step(s):
    out = s.schedule()
    sampled = {r.request_id: [7] for r in out.scheduled_requests
               if r.num_computed_tokens >= r.num_tokens}
    s.update_from_output(out, sampled)
    check_state(s)
    return out


def running_adapters(s):
    return {r.lora_request.lora_name for r in s.running if r.lora_request is not None}


def test_request_for_a_second_adapter_waits_without_blocking_the_others():
    s = make(max_loras=1)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("base", None), ("b2", "b")):
        s.add_request(req(rid, adapter))
    out = run_step(s)
    assert [r.request_id for r in out.scheduled_requests] == ["a1", "a2", "base"]
    # The passed-over ones keep their order at the head of WAITING.
    assert [r.request_id for r in s.waiting] == ["b1", "b2"]
    while s.has_unfinished_requests():
        run_step(s)
        assert len(running_adapters(s)) <= 1
    # b's requests ran once a's had finished.


def test_two_slots_admit_two_adapters_and_the_third_waits():
    s = make(max_loras=2)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("c1", "c"), ("b2", "b")):
        s.add_request(req(rid, adapter))
    out = run_step(s)
    assert [r.request_id for r in out.scheduled_requests] == ["a1", "b1", "b2"]
    assert [r.request_id for r in s.waiting] == ["c1"]
    seen = set()
    while s.has_unfinished_requests():
        run_step(s)
        assert len(running_adapters(s)) <= 2
        seen |= running_adapters(s)
    assert seen == {"a", "b", "c"}


def test_without_enable_lora_the_limit_does_not_apply():
    s = make(max_loras=1, enable=False)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("c1", "c")):
        s.add_request(req(rid, adapter))
    assert len(run_step(s).scheduled_requests) == 3


def test_block_hashes_carry_the_adapter_as_vllm_does():
    """vLLM 0.32's extra keys: ("lora", name, path) on every block, before cache_salt
    (which is on the first block only)."""
    hasher = BlockHasher("sha256")
    tokens = list(range(1, 33))
    plain = Request("p", tokens)
    lora = Request("l", tokens, lora_request=ADAPTERS["a"], cache_salt="s")
    update_block_hashes(plain, 16, hasher)
    update_block_hashes(lora, 16, hasher)
    key = ("lora", "a", "/adapters/a")
    first = hasher.hash_block(None, tuple(tokens[:16]), (key, ("cache_salt", "s")))
    second = hasher.hash_block(first, tuple(tokens[16:]), (key,))
    assert lora.block_hashes == [first, second]
    assert set(plain.block_hashes).isdisjoint(lora.block_hashes)
    # The same name at another path is another adapter.
    moved = Request("m", tokens, lora_request=LoRARequest("a", 1, "/elsewhere"), cache_salt="s")
    update_block_hashes(moved, 16, hasher)
    assert moved.block_hashes[0] != first


def test_stats_name_the_adapters_with_requests_as_vllm_does():
    """vLLM 0.32 fills both dicts with every adapter that has a request in flight (the
    counts say where they are); vllm:lora_requests_info's labels are their keys."""
    s = make(max_loras=1)
    for rid, adapter in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("base", None)):
        s.add_request(req(rid, adapter))
    stats = s.get_stats()
    assert stats.running_lora_adapters == {"a": 0, "b": 0}
    assert stats.waiting_lora_adapters == {"a": 2, "b": 1}
    run_step(s)
    stats = s.get_stats()
    assert stats.running_lora_adapters == {"a": 2, "b": 0}
    assert stats.waiting_lora_adapters == {"a": 0, "b": 1}
    assert make(enable=False).get_stats().running_lora_adapters == {}


def test_kv_events_carry_the_adapter_as_vllm_does():
    """vLLM 0.32's BlockStored names the adapter (lora_id, deprecated there, and
    lora_name); a base-model block leaves both out."""
    from engine.core.kv_cache.publisher import encode_batch
    from tests.engine.core.kv_cache.test_kv_events import _vllm_message_types

    decoder, BlockStored = _vllm_message_types()
    s = Scheduler(SchedulerConfig(max_model_len=512), CacheConfig(num_kv_blocks=50, block_size=16),
                  enable_kv_events=True, lora_config=LoRAConfig(enable_lora=True, max_loras=2))
    s.add_request(req("a1", "b", n=40))
    s.add_request(req("base", None, n=40))
    run_step(s)
    batch = decoder.decode(encode_batch(1.0, s.kv_cache_manager.take_events()))
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [(e.lora_id, e.lora_name) for e in stored] == [(2, "b"), (None, None)]
