"""The KV-event publisher never makes the engine wait: a subscriber that never reads
costs the publishing thread nothing (PUB drops at its hwm), and a queue to that thread
that is full refuses the batch at once, counting it, with one log line."""
from __future__ import annotations

import logging
import time

import zmq

from engine.config.kv_events import KVEventsConfig
from engine.core.kv_cache.events import AllBlocksCleared, BlockRemoved
from engine.core.kv_cache.publisher import ZmqEventPublisher
from tests.engine.core.kv_cache.test_kv_events import _free_port, _replay_all

BATCHES = 3000


def _config(**extra) -> tuple[KVEventsConfig, int, int]:
    pub_port, replay_port = _free_port(), _free_port()
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                          replay_endpoint=f"tcp://*:{replay_port}", topic="kv",
                          buffer_steps=BATCHES, **extra), pub_port, replay_port


def _deaf_subscriber(port: int):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def _batch(i: int) -> list:
    # ~5 KB on the wire: the batches outgrow the loopback socket buffers many times over.
    return [BlockRemoved(block_hashes=[i.to_bytes(32, "big")] * 512), AllBlocksCleared()]


def test_a_subscriber_that_never_reads_holds_nothing_up(caplog):
    config, pub_port, replay_port = _config(hwm=8)
    publisher = ZmqEventPublisher(config)
    deaf = _deaf_subscriber(pub_port)
    try:
        with caplog.at_level(logging.ERROR):
            for i in range(BATCHES):
                publisher.publish(_batch(i))
            # Every batch went out of the thread: the deaf one never blocked a send.
            assert publisher.flush(timeout=60)
        assert publisher.dropped == 0 and publisher.next_seq == BATCHES
        assert not caplog.records
        # What the deaf one holds is bounded by the hwms and the socket buffers (loopback
        # TCP autotuning let ~2000 of the 3000 through on one loaded host); the rest was
        # dropped for it alone (replay still has every batch).
        held = 0
        while deaf.poll(200):
            deaf.recv_multipart()
            held += 1
        assert held < BATCHES, held
        assert [seq for seq, _ in _replay_all(replay_port, 0)] == list(range(BATCHES))
    finally:
        deaf.close(linger=0)
        publisher.shutdown()


def test_a_replay_longer_than_zmqs_default_hwm_reaches_a_slow_reader_whole():
    # ZMQ's ROUTER drops silently past its send hwm (1000 by default); a client that asks
    # for the whole buffer and reads only later must still get every batch, in order.
    config, _, replay_port = _config()
    publisher = ZmqEventPublisher(config)
    slow = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for i in range(BATCHES):
            publisher.publish(_batch(i))
        assert publisher.flush(timeout=60)
        slow.setsockopt(zmq.RCVHWM, 1)
        slow.setsockopt(zmq.RCVBUF, 4096)
        slow.connect(f"tcp://127.0.0.1:{replay_port}")
        slow.send_multipart((b"", (0).to_bytes(8, "big")))
        time.sleep(1.0)  # the publisher answers in milliseconds; we read after it is done
        seqs = []
        while True:
            assert slow.poll(5000), "replay did not finish"
            _, _, seq_bytes, _ = slow.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                break
            seqs.append(seq)
        assert seqs == list(range(BATCHES))
    finally:
        slow.close(linger=0)
        publisher.shutdown()


def test_a_full_queue_drops_and_counts_at_once_with_one_log_line(caplog):
    config, _, replay_port = _config(max_queue_size=1)
    publisher = ZmqEventPublisher(config)
    try:
        with caplog.at_level(logging.ERROR):
            # Faster than the thread drains: a tight loop keeps the GIL for whole
            # switch intervals, so a queue of one is full most of the time.
            for i in range(BATCHES):
                publisher.publish(_batch(i))
            assert publisher.flush(timeout=60)
        sent = publisher.next_seq
        assert publisher.dropped > 0 and sent + publisher.dropped == BATCHES
        assert [seq for seq, _ in _replay_all(replay_port, 0)] == list(range(sent))
        errors = [r.getMessage() for r in caplog.records]
        assert len(errors) == 1 and "vllm:kv_events_dropped_total" in errors[0], errors
    finally:
        publisher.shutdown()
