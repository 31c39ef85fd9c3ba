"""The engine's KV-event stream read by vLLM 0.32's own code, as a subscriber reads a vLLM
engine's: a script under vLLM's interpreter subscribes to our PUB socket, decodes every
payload with msgspec's decoder over vLLM's KVEventBatch (vllm/distributed/kv_events.py,
as vLLM's examples/online_serving/kv_events_subscriber.py does), and on a gap in the
sequence numbers asks our replay ROUTER for the missed batches from a DEALER socket the
way a client of vLLM's ZmqEventPublisher must: [b"", start seq] out; [b"", topic, seq,
payload] back per batch (the frames PUB sent it with, three behind the delimiter, as
llm-d's subscriber requires), until vLLM's END_SEQ marker [b"", b"", -1, b""].

The engine is the real one (the tiny model from testing/) with KV events on. It runs
part of its workload before the subscriber exists, so the subscriber joins mid-stream
and must get batches 0.. by replay, then the rest live; every decoded event must be the
one the engine published for that sequence number, field by field."""
import json
import random
import select
import socket
import time

import pytest

from engine.core.kv_cache import AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from engine.sampling_params import SamplingParams

TOPIC = "kv@10.1.2.3:9000@llm"
SALT = "tenant-a"

# Runs under vLLM's interpreter. Line 1 of stdin: the addresses; it prints "ready" once
# its sockets are up; a later line: the last sequence number the engine published. Then
# it makes sure it holds 0..last (replaying what it lacks) and prints its record.
SUBSCRIBER = r"""
import json, select, sys, time
import msgspec, zmq
from msgspec.msgpack import Decoder
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

args = json.loads(sys.stdin.readline())
decoder = Decoder(type=KVEventBatch)
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt_string(zmq.SUBSCRIBE, args["topic"])
sub.connect(args["pub"])
replay = ctx.socket(zmq.DEALER)
replay.connect(args["replay"])
got, replays, live = {}, [], []

def record(seq, via, topic, payload):
    batch = decoder.decode(payload)  # vLLM's types: a layout they do not accept raises
    events = [dict({f: getattr(e, f) for f in e.__struct_fields__}, type=type(e).__name__)
              for e in batch.events]
    got[seq] = {"seq": seq, "via": via, "topic": topic.decode(), "ts": batch.ts,
                "data_parallel_rank": batch.data_parallel_rank, "events": events}

def request_replay(start):
    replay.send_multipart([b"", start.to_bytes(8, "big")])
    info = {"start": start, "seqs": [], "topics": [], "bad": None, "end": None}
    while True:
        if not replay.poll(10000):
            info["bad"] = "no END_SEQ within 10 s"
            break
        frames = replay.recv_multipart()
        if len(frames) != 4 or frames[0] != b"":
            info["bad"] = f"expected the delimiter plus 3 frames, got {len(frames)} frames"
            break
        _, topic, seq_bytes, payload = frames
        if seq_bytes == ZmqEventPublisher.END_SEQ:
            info["end"] = [topic.decode(), payload.hex()]
            break
        seq = int.from_bytes(seq_bytes, "big")
        info["seqs"].append(seq)
        info["topics"].append(topic.decode())
        if seq not in got:
            record(seq, "replay", topic, payload)
    replays.append(info)

print("ready", flush=True)
last, end_at, deadline = -1, None, time.monotonic() + 120
while time.monotonic() < deadline:
    if sub.poll(20):
        frames = sub.recv_multipart()
        assert len(frames) == 3, f"PUB message of {len(frames)} frames"
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        live.append(seq)
        if seq > last + 1:  # missed batches (a late join included): replay them first
            request_replay(last + 1)
            if replays[-1]["bad"]:
                break
        if seq not in got:
            record(seq, "live", topic, payload)
        last = max(last, seq)
    if end_at is None and select.select([sys.stdin], [], [], 0)[0]:
        end_at = int(sys.stdin.readline())
    if end_at is not None:
        if last < end_at:
            request_replay(last + 1)
            if replays[-1]["bad"]:
                break
            last = max(got) if got else -1
        if last >= end_at:
            break
print(json.dumps({"batches": [got[s] for s in sorted(got)], "replays": replays,
                  "live": live, "end_at": end_at}))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wire(event) -> dict:
    """What vLLM's BlockStored / BlockRemoved / AllBlocksCleared hold for one of our
    events, written from vLLM 0.32's block pool (what it fills; the rest stays None)."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": [external_hash(h) for h in event.block_hashes],
                "parent_block_hash": (None if event.parent_block_hash is None
                                      else external_hash(event.parent_block_hash)),
                "token_ids": list(event.token_ids), "block_size": event.block_size,
                "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [None if k is None else list(k) for k in event.extra_keys],
                "group_idx": 0}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in event.block_hashes],
                "medium": "GPU", "group_idx": 0}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def _read_line(proc, timeout: float, stderr_path) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        if select.select([proc.stdout], [], [], 0.2)[0]:
            line = proc.stdout.readline()
            if line:
                return line
    raise AssertionError(f"vLLM-side subscriber gave no line (rc {proc.poll()}):\n"
                         f"{stderr_path.read_text()[-4000:]}")


def test_vllms_subscriber_decodes_our_stream_and_replays_what_it_missed(vllm_side, tmp_path):
    from engine import LLMEngine
    from testing.tiny_model import make_tiny_model_dir

    pub_port, replay_port = _free_port(), _free_port()
    engine = LLMEngine(model=str(make_tiny_model_dir(tmp_path / "tiny")), dtype="float32",
                       num_kv_blocks=12, block_size=4, max_num_seqs=4, max_model_len=48,
                       prefix_caching_hash_algo="sha256_cbor",
                       kv_events_config={"enable_kv_cache_events": True, "topic": TOPIC,
                                         "endpoint": f"tcp://*:{pub_port}",
                                         "replay_endpoint": f"tcp://*:{replay_port}"})
    published: list[list[dict]] = []  # by sequence number: what the engine handed over
    send = engine.kv_events.publish

    def publish(events):
        if events:
            published.append([_wire(e) for e in events])
        send(events)
    engine.kv_events.publish = publish
    stderr_path = tmp_path / "subscriber.stderr"
    proc = None
    rng = random.Random(0)
    shared = [rng.randrange(5, 90) for _ in range(8)]
    salted_first = [95, 96, 97, 98]  # only salted prompts begin with this block

    def run(requests):
        for rid, prompt, salt, max_tokens in requests:
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                           ignore_eos=True), cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
    try:
        # Before anyone listens: a salted prompt and two sharing a prefix.
        run([("s0", salted_first + shared + [3, 1], SALT, 2)])
        run([("a0", shared + [9, 9], None, 2)])
        run([("a1", shared + [8, 8, 8, 8, 7], None, 2)])
        missed = len(published)
        assert missed >= 3
        proc = vllm_side.start(SUBSCRIBER, stderr_path)
        proc.stdin.write(json.dumps({"topic": TOPIC, "pub": f"tcp://127.0.0.1:{pub_port}",
                                     "replay": f"tcp://127.0.0.1:{replay_port}"}) + "\n")
        proc.stdin.flush()
        assert _read_line(proc, 180, stderr_path).strip() == "ready"
        time.sleep(1.0)  # the subscription reaches PUB (anything it misses is replayed)
        # Live: more than the pool holds (evictions, preemptions), then a reset.
        run([(f"r{i}", shared + [rng.randrange(5, 90) for _ in range(rng.randrange(3, 12))],
              None, 14) for i in range(6)])
        engine.reset_prefix_cache()
        run([("after", salted_first + shared[:4] + [7, 7, 7], SALT, 2)])
        assert engine.kv_events.flush()
        proc.stdin.write(f"{len(published) - 1}\n")
        proc.stdin.flush()
        result = json.loads(_read_line(proc, 120, stderr_path))
        proc.wait(30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        engine.close()

    batches = result["batches"]
    assert all(a["bad"] is None for a in result["replays"]), result["replays"]
    # Every batch, once, in order: the missed ones by replay, the rest live.
    assert [b["seq"] for b in batches] == list(range(len(published)))
    assert all(b["via"] == "replay" for b in batches[:missed])
    assert any(b["via"] == "live" for b in batches[missed:]), "nothing arrived live"
    assert result["live"], "the subscriber heard no live message"
    # The replay answers: from 0 on the late join, each batch with its topic, vLLM's
    # end marker (empty topic and payload) last, never a malformed reply.
    replays = result["replays"]
    assert replays and replays[0]["start"] == 0
    for answer in replays:
        assert answer["bad"] is None, answer["bad"]
        assert answer["end"] == ["", ""]
        assert set(answer["topics"]) <= {TOPIC}
        assert answer["seqs"] == list(range(answer["start"], answer["start"] + len(answer["seqs"])))
    assert replays[0]["seqs"][:missed] == list(range(missed))
    # Each decoded batch is what the engine published under that number.
    for batch, expected in zip(batches, published):
        assert batch["topic"] == TOPIC and batch["data_parallel_rank"] == 0
        assert isinstance(batch["ts"], float) and abs(batch["ts"] - time.time()) < 600
        assert len(batch["events"]) == len(expected), batch["seq"]
        for got, want in zip(batch["events"], expected):
            assert {k: got[k] for k in want} == want, batch["seq"]
            assert all(v is None for k, v in got.items() if k not in want), got
    events = [e for b in batches for e in b["events"]]
    assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= {e["type"] for e in events}
    # The salt, bare, on a salted prompt's first block (published before the subscriber
    # came, and after the reset); None on every other block.
    stored = [e for e in events if e["type"] == "BlockStored"]
    first_blocks = [e for e in stored if e["parent_block_hash"] is None]
    salted_events = [e for e in first_blocks if e["token_ids"][:4] == salted_first]
    assert len(salted_events) == 2
    assert all(e["extra_keys"][0] == [SALT] for e in salted_events)
    assert all(e["extra_keys"][0] is None for e in first_blocks if e not in salted_events)
    assert all(k is None for e in stored for k in e["extra_keys"][1:])
    assert all(len(e["extra_keys"]) == len(e["block_hashes"]) for e in stored)
    # Through vLLM's decoder, the stream rebuilds exactly the set the engine can hit.
    keys = set()
    for e in events:
        if e["type"] == "BlockStored":
            keys.update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            keys.difference_update(e["block_hashes"])
        else:
            keys.clear()
    assert keys == {external_hash(h)
                    for h in engine.scheduler.kv_cache_manager.block_pool.cached_blocks}
    assert keys


@pytest.mark.parametrize("topic", ["", "kv@llm"])
def test_replay_from_a_sequence_answers_as_vllms_publisher_does(vllm_side, topic):
    """The same replay request to vLLM's own ZmqEventPublisher and to ours, each with the
    same three buffered batches: the frames that come back are the same, but for the
    payload bytes (each side's own encoding of its batch)."""
    from engine.core.kv_cache.publisher import ZmqEventPublisher
    from engine.config import KVEventsConfig

    script = r"""
import json, sys, time, zmq
cfg = json.load(sys.stdin)

def ask(address, start):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(address)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(10000), "no END_SEQ"
        frames = dealer.recv_multipart()
        out.append([frames[0].hex(), frames[1].decode(), frames[2].hex(), len(frames[3])])
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            break
    dealer.close(0)
    return out

if cfg.get("vllm_port"):
    from vllm.distributed.kv_events import EventBatch, ZmqEventPublisher
    pub = ZmqEventPublisher(0, endpoint="inproc://conformance-pub",
                            replay_endpoint=f"tcp://*:{cfg['vllm_port']}", topic=cfg["topic"])
    for i in range(3):
        pub.publish(EventBatch(ts=float(i), events=[]))
    time.sleep(0.5)
    vllm = {str(s): ask(f"tcp://127.0.0.1:{cfg['vllm_port']}", s) for s in (0, 2, 3)}
    pub.shutdown()
else:
    vllm = None
ours = {str(s): ask(f"tcp://127.0.0.1:{cfg['our_port']}", s) for s in (0, 2, 3)}
print(json.dumps({"vllm": vllm, "ours": ours}))
"""
    our_port, vllm_port = _free_port(), _free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(
        enable_kv_cache_events=True, endpoint="inproc://ours", topic=topic,
        replay_endpoint=f"tcp://*:{our_port}"))
    try:
        for i in range(3):
            publisher.publish([AllBlocksCleared()] * (i + 1))
        assert publisher.flush()
        got = vllm_side.run(script, {"topic": topic, "our_port": our_port, "vllm_port": vllm_port})
    finally:
        publisher.shutdown()

    def shape(frames):  # payload bytes aside
        return [f[:3] + [f[3] > 0] for f in frames]
    for start in ("0", "2", "3"):
        assert shape(got["ours"][start]) == shape(got["vllm"][start]), start
    assert [f[1] for f in got["ours"]["0"]] == [topic] * 3 + [""]
    assert [f[2] for f in got["ours"]["2"]] == [(2).to_bytes(8, "big").hex(),
                                                (-1).to_bytes(8, "big", signed=True).hex()]
