"""KV-cache events: reproducible block hashes, events that rebuild the cached set through
the wire, vLLM's message layout, the ZMQ publisher with replay, and the config path."""
import hashlib
import pickle
import random
import socket

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.kv_cache import BlockHasher, external_hash, update_block_hashes
from engine.config import KVEventsConfig
from engine.core.kv_cache.publisher import ZmqEventPublisher, encode_batch
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from testing.fake_model import FakeModelRunner
from tests.engine.core.test_scheduler_properties import drive, examples, workloads
from tuning.kv_index import KVEventIndex, decode_batch


def outside_sha256_cbor_chain(tokens, block_size, seed="vllm-none-hash", salt=None):
    """What an indexer outside the process computes (vLLM's recipe, written from its
    description, not from this engine's code)."""
    def h(value):
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()
    parent, out = h(seed), []
    for i in range(len(tokens) // block_size):
        extra = (("cache_salt", salt),) if (i == 0 and salt) else None
        parent = h((parent, tuple(tokens[i * block_size:(i + 1) * block_size]), extra))
        out.append(parent)
    return out


def engine_set(scheduler):
    return {external_hash(h) for h in scheduler.kv_cache_manager.block_pool.cached_blocks}


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_sha256_cbor_block_hashes_are_what_an_outside_indexer_computes(salt, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(100, 170))
    request = Request("r", tokens, SamplingParams(max_tokens=1), cache_salt=salt)
    got = update_block_hashes(request, 16, BlockHasher("sha256_cbor"))
    assert got == outside_sha256_cbor_chain(tokens, 16, salt=salt)
    assert len(got) == 4
    # On the wire: the digest's low 64 bits, big-endian, unsigned (vLLM's default).
    assert external_hash(got[0]) == int.from_bytes(got[0][-8:], "big")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert external_hash(got[0]) == got[0]


def test_pythonhashseed_seeds_the_chain_as_in_vllm(monkeypatch):
    tokens = list(range(32))
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    seeded = update_block_hashes(Request("a", tokens, SamplingParams()), 16, BlockHasher("sha256_cbor"))
    assert seeded == outside_sha256_cbor_chain(tokens, 16, seed="1234")
    monkeypatch.delenv("PYTHONHASHSEED")
    unseeded = update_block_hashes(Request("b", tokens, SamplingParams()), 16, BlockHasher("sha256_cbor"))
    assert seeded[0] != unseeded[0]


def test_sha256_pickles_the_same_tuple(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    tokens = list(range(16))

    def h(value):
        return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    got = update_block_hashes(Request("r", tokens, SamplingParams()), 16, BlockHasher("sha256"))
    assert got == [h((h("vllm-none-hash"), tuple(tokens), None))]


def test_unknown_hash_algo_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="sha256_cbor"):
        CacheConfig(prefix_caching_hash_algo="md5")
    assert CacheConfig().prefix_caching_hash_algo == "builtin"


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_algos_load_and_seed_as_vllm_does(algo, monkeypatch):
    """vLLM's two non-cryptographic algorithms: XXH3-128 of the pickled / CBOR tuple. Their
    first parent is seeded from PYTHONHASHSEED when set, else from random bytes drawn once
    per process (tests/conformance/test_block_hash_vllm.py checks vLLM's own values)."""
    import xxhash

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    config = EngineConfig.from_dict({"prefix_caching_hash_algo": algo})
    assert config.cache.prefix_caching_hash_algo == algo
    s = _scheduler(num_blocks=8, algo=algo)
    s.add_request(Request("r", list(range(1, 11)), SamplingParams(max_tokens=1)))
    s.schedule()
    hashes = s.requests["r"].block_hashes
    serialize = ((lambda v: pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)) if algo == "xxhash"
                 else (lambda v: cbor2.dumps(v, canonical=True)))

    def h(value):
        return xxhash.xxh3_128_digest(serialize(value))
    first = h((h("0"), (1, 2, 3, 4), None))
    assert hashes == [first, h((first, (5, 6, 7, 8), None))]
    assert all(len(x) == 16 for x in hashes)
    monkeypatch.delenv("PYTHONHASHSEED")
    unseeded = BlockHasher(algo)
    assert unseeded.none_hash not in (h("0"), h("vllm-none-hash"))
    # One seed per process: every hasher in it agrees.
    assert BlockHasher(algo).none_hash == unseeded.none_hash


def _scheduler(num_blocks, algo="sha256_cbor", **sched):
    return Scheduler(SchedulerConfig(max_model_len=256, **sched),
                     CacheConfig(num_kv_blocks=num_blocks, block_size=4,
                                 prefix_caching_hash_algo=algo), enable_kv_events=True)


def _run(s, runner):
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))


def test_stored_removed_and_cleared_events_name_chains_and_skip_duplicates():
    s = _scheduler(num_blocks=12, max_num_seqs=4)
    runner = FakeModelRunner(12, 4)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    s.add_request(Request("a", list(range(1, 11)), params))  # 2 full blocks + 2 tokens
    out = s.schedule()
    events = s.kv_cache_manager.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored"]
    stored = events[0]
    a_hashes = s.requests["a"].block_hashes[:2]
    assert stored.block_hashes == a_hashes and stored.parent_block_hash is None
    assert stored.token_ids == list(range(1, 9)) and stored.block_size == 4
    s.update_from_output(out, runner.execute(out))
    # b shares a's first block: only its second block is new, chained to a's first.
    s.add_request(Request("b", [1, 2, 3, 4, 50, 51, 52, 53, 54], params))
    # c repeats b's prompt in the same step: its blocks are duplicates, so b announces them
    # and c nothing (c hits nothing yet: b's blocks were not cached when c was looked up).
    s.add_request(Request("c", [1, 2, 3, 4, 50, 51, 52, 53, 54], params))
    out = s.schedule()
    events = s.kv_cache_manager.take_events()
    assert len(events) == 1
    assert events[0].block_hashes == [s.requests["b"].block_hashes[1]]
    assert events[0].parent_block_hash == a_hashes[0]
    assert events[0].token_ids == [50, 51, 52, 53]
    s.update_from_output(out, runner.execute(out))
    _run(s, runner)
    s.kv_cache_manager.take_events()
    # Fill the pool with fresh prompts: the LRU evicts cached blocks, announced as removed.
    before = engine_set(s)
    s.add_request(Request("d", list(range(100, 145)), params))
    _run(s, runner)
    events = s.kv_cache_manager.take_events()
    removed = {external_hash(h) for e in events if type(e).__name__ == "BlockRemoved"
               for h in e.block_hashes}
    assert removed and removed <= before and not removed & engine_set(s)
    s.kv_cache_manager.reset_prefix_cache()
    assert type(s.kv_cache_manager.take_events()[-1]).__name__ == "AllBlocksCleared"
    assert engine_set(s) == set()


@settings(max_examples=examples(0.4), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), st.sampled_from(["builtin", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
       st.randoms())
def test_events_rebuild_the_cached_set_after_any_workload(workload, algo, rnd):
    """Through the wire (encode, decode), after every step of a random workload with
    evictions, preemptions, aborts and an occasional reset_prefix_cache, the subscriber's
    set is exactly the engine's."""
    sched, cache, specs = workload
    cache.prefix_caching_hash_algo = algo
    index = KVEventIndex()

    def maybe_reset(s):
        if rnd.random() < 0.03:
            s.kv_cache_manager.reset_prefix_cache()

    def publish(s, step):
        events = s.kv_cache_manager.take_events()
        if events:
            index.apply(index.next_seq, encode_batch(float(step), events))
        assert index.keys == engine_set(s)

    drive(sched, cache, specs, check=False, enable_kv_events=True,
          before_schedule=maybe_reset, after_step=publish)
    if not cache.enable_prefix_caching:
        assert index.num_batches == 0


def _vllm_message_types():
    """vLLM 0.32's message types (vllm/distributed/kv_events.py), restated from their
    published definitions: the batch is array-like, events are maps tagged by "type" with
    defaulted fields omitted. Decoding our bytes with them is the wire-compatibility check."""
    msgspec = pytest.importorskip("msgspec", reason="msgspec is not installed (pip install -e '.[test]')")

    class Event(msgspec.Struct, omit_defaults=True, tag=True):
        pass

    class BlockStored(Event):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None

    class BlockRemoved(Event):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(Event):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return msgspec.msgpack.Decoder(KVEventBatch), BlockStored


def test_payload_decodes_with_vllms_message_types():
    decoder, BlockStored = _vllm_message_types()
    s = _scheduler(num_blocks=6, max_num_seqs=2)
    runner = FakeModelRunner(6, 4)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i in range(3):
        s.add_request(Request(f"r{i}", [i * 50 + t for t in range(1, 11)], params))
    _run(s, runner)
    s.kv_cache_manager.reset_prefix_cache()
    events = s.kv_cache_manager.take_events()
    batch = decoder.decode(encode_batch(12.5, events))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    kinds = [type(e).__name__ for e in batch.events]
    assert {"BlockStored", "BlockRemoved"} <= set(kinds) and kinds[-1] == "AllBlocksCleared"
    first = batch.events[0]
    assert isinstance(first, BlockStored) and first.parent_block_hash is None
    assert first.token_ids == list(range(1, 9))
    assert first.medium == "GPU" and first.lora_id is None and first.block_size == 4
    # vLLM 0.32's block pool: one extra-keys entry per block, the one KV-cache group.
    assert first.extra_keys == [None, None] and first.group_idx == 0
    assert all(e.group_idx == 0 for e in batch.events if hasattr(e, "group_idx"))
    assert all(0 <= h < 2**64 for e in batch.events if hasattr(e, "block_hashes")
               for h in e.block_hashes)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _subscriber(port, topic=b""):
    import zmq

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _receive(sub, count, timeout_ms=5000):
    got = []
    while len(got) < count:
        if not sub.poll(timeout_ms):
            raise AssertionError(f"received {len(got)} of {count} messages")
        got.append(sub.recv_multipart())
    return got


def _replay_all(port, start_seq, topic=None):
    """[(seq, payload)] from the replay socket, driven as a client of vLLM's publisher
    does; each batch's topic frame must be `topic` when given."""
    import zmq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
    out = []
    while True:
        assert dealer.poll(5000), "replay did not finish"
        # vLLM's replay frames: the batch as PUB sent it, (topic, seq, payload), behind
        # the DEALER's empty delimiter; the end marker has an empty topic and payload.
        empty, frame_topic, seq_bytes, payload = dealer.recv_multipart()
        assert empty == b""
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq == -1:
            assert (frame_topic, payload) == (b"", b"")
            break
        assert topic is None or frame_topic == topic, (frame_topic, topic)
        out.append((seq, payload))
    dealer.close(linger=0)
    return out


def test_zmq_publisher_sends_topic_seq_payload_and_replays_from_a_sequence():
    pub_port, replay_port = _free_port(), _free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                            replay_endpoint=f"tcp://*:{replay_port}", topic="kv", buffer_steps=3)
    publisher = ZmqEventPublisher(config)
    try:
        sub = _subscriber(pub_port, b"kv")
        # PUB drops what it sends before the subscription has reached it: probe until one
        # arrives, then count from the next sequence number.
        s = _scheduler(num_blocks=16, max_num_seqs=2)
        runner = FakeModelRunner(16, 4)
        for i in range(5):
            s.add_request(Request(f"r{i}", [i * 40 + t for t in range(1, 14)],
                                  SamplingParams(max_tokens=1, ignore_eos=True)))
        batches = []
        while s.has_unfinished_requests():
            out = s.schedule()
            s.update_from_output(out, runner.execute(out))
            events = s.kv_cache_manager.take_events()
            if events:
                batches.append(events)
        import time
        deadline = time.monotonic() + 5
        received = []
        while not received:
            assert time.monotonic() < deadline, "subscriber never connected"
            publisher.publish(batches[0])
            if sub.poll(100):
                received.append(sub.recv_multipart())
        first_seq = int.from_bytes(received[0][1], "big")
        for events in batches:
            publisher.publish(events)
        assert publisher.flush()
        msgs = _receive(sub, len(batches))
        topics = {m[0] for m in msgs}
        seqs = [int.from_bytes(m[1], "big") for m in msgs]
        assert topics == {b"kv"}
        assert seqs == list(range(first_seq + 1, first_seq + 1 + len(batches)))
        index = KVEventIndex(next_seq=first_seq + 1)
        for seq, (_, _, payload) in zip(seqs, msgs):
            index.apply(seq, payload)
        assert index.keys == engine_set(s)
        # Replay keeps the last buffer_steps batches: asking from 0 gets those three.
        replayed = _replay_all(replay_port, 0, topic=b"kv")
        assert [seq for seq, _ in replayed] == seqs[-3:]
        assert [p for _, p in replayed] == [m[2] for m in msgs[-3:]]
        assert _replay_all(replay_port, seqs[-1] + 1) == []
        sub.close(linger=0)
    finally:
        publisher.shutdown()
    # The ports are free again once it is shut down (a reloaded model binds them anew).
    again = ZmqEventPublisher(config)
    again.shutdown()


def test_kv_events_config_values_and_errors():
    c = KVEventsConfig.from_value("x", '{"enable_kv_cache_events": "true", "hwm": "10"}')
    assert c.publisher == "zmq" and c.hwm == 10 and c.active
    assert not KVEventsConfig.from_value("x", {"enable_kv_cache_events": False}).active
    assert KVEventsConfig.from_value("x", "null") is None
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.from_value("x", {"endpoints": "tcp://*:1"})
    with pytest.raises(ValueError, match="JSON object"):
        KVEventsConfig.from_value("x", "{not json")
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_value("x", {"enable_kv_cache_events": True, "publisher": "kafka"})
    config = EngineConfig.from_dict({"kv_events_config": {"enable_kv_cache_events": True},
                                     "prefix_caching_hash_algo": "sha256_cbor"})
    assert config.kv_events_config.endpoint == "tcp://*:5557"


def test_port_in_use_is_a_clear_error():
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot open endpoint 'tcp://\\*:{port}'"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True,
                                             endpoint=f"tcp://*:{port}"))


def test_model_json_takes_vllms_kv_events_config():
    from backend.model_json import parse_model_json

    parsed = parse_model_json({"kv_events_config": {"enable_kv_cache_events": True,
                                                    "publisher": "zmq", "topic": "kv"},
                               "prefix_caching_hash_algo": "sha256_cbor"})
    assert parsed.engine_args["prefix_caching_hash_algo"] == "sha256_cbor"
    config = EngineConfig.from_dict(parsed.engine_args)
    assert config.kv_events_config.topic == "kv"
    with pytest.raises(ValueError, match="kv_events_config"):
        parse_model_json({"kv_events_config": {"enable_kv_cache_event": True}})
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        parse_model_json({"prefix_caching_hash_algo": "md5"})
    assert parse_model_json({"prefix_caching_hash_algo": "xxhash_cbor"}).engine_args[
        "prefix_caching_hash_algo"] == "xxhash_cbor"


def test_real_engine_publishes_what_it_caches(tmp_path):
    """The real engine and model: a subscriber started before the first request rebuilds
    the cache through preemptions and a reset, with consecutive sequence numbers."""
    from engine import LLMEngine
    from testing.tiny_model import make_tiny_model_dir

    port, replay_port = _free_port(), _free_port()
    engine = LLMEngine(model=str(make_tiny_model_dir(tmp_path / "tiny")), dtype="float32",
                       num_kv_blocks=12, block_size=4, max_num_seqs=4, max_model_len=48,
                       prefix_caching_hash_algo="sha256_cbor",
                       kv_events_config={"enable_kv_cache_events": True,
                                         "endpoint": f"tcp://*:{port}",
                                         "replay_endpoint": f"tcp://*:{replay_port}"})
    try:
        sub = _subscriber(port)
        rng = random.Random(0)
        shared = [rng.randrange(5, 90) for _ in range(8)]
        for i in range(6):
            tail = [rng.randrange(5, 90) for _ in range(rng.randrange(3, 12))]
            engine.add_request(f"r{i}", shared + tail,
                               SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        preemptions = engine.scheduler.num_preemptions_total
        engine.reset_prefix_cache()
        engine.add_request("after", shared + [7, 7, 7],
                           SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        expected = engine_set(engine.scheduler)
        assert expected
        # The whole history from the replay socket (a subscriber that joins late misses
        # what PUB sent before its subscription arrived), then the live stream's part of
        # it must be the same bytes under the same numbers.
        assert engine.kv_events.flush()
        replayed = _replay_all(replay_port, 0, topic=b"")
        index = KVEventIndex()
        for seq, payload in replayed:
            index.apply(seq, payload)
        live = {}
        while sub.poll(500):
            seq_bytes, payload = sub.recv_multipart()[1:]
            live[int.from_bytes(seq_bytes, "big")] = payload
        assert all(dict(replayed)[seq] == payload for seq, payload in live.items())
        assert index.keys == expected
        assert preemptions > 0, "the workload was meant to preempt"
        # The index answers routing questions in the outside indexer's terms.
        prompt = shared + [7, 7, 7]
        keys = [int.from_bytes(h[-8:], "big") for h in outside_sha256_cbor_chain(prompt, 4)]
        assert index.prefix_hits(keys) == len(prompt) // 4
        sub.close(linger=0)
    finally:
        engine.close()
