"""KV-cache events on the wire, as vLLM publishes them, so prefix-aware routers (llm-d's
KV indexer, Dynamo's KV router) index this engine without knowing it.

Wire format (vLLM 0.32, vllm/distributed/kv_events.py, ZmqEventPublisher, which the peer
bench/vllm_peer.py runs; tests/conformance/ reads ours with vLLM's own decoder):
- a ZMQ PUB socket sends one multipart message per engine step that changed the cache:
  (topic, sequence number as 8 bytes big-endian, msgpack payload);
- the payload is the batch as an array [ts, events, data_parallel_rank]; each event is a
  map tagged by "type" ("BlockStored", "BlockRemoved", "AllBlocksCleared") with the
  fields in vLLM's order, fields left at their defaults omitted (msgspec omit_defaults);
- a ROUTER socket (replay_endpoint) answers a request (identity, b"", start sequence as 8
  bytes big-endian) with every buffered batch from there on as (identity, b"", topic,
  seq, payload), the frames a live subscriber gets, then (identity, b"", b"", -1 as 8
  signed bytes, b""). A DEALER client thus reads (b"", topic, seq, payload) per batch.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from engine.config.kv_events import KVEventsConfig, binds
from engine.core.kv_cache.events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                         KVCacheEvent, external_hash)

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def event_to_wire(event: KVCacheEvent) -> dict[str, Any]:
    """vLLM 0.32's fields in its order: the required ones always, then extra_keys and
    group_idx as its block pool fills them (session_id, locality, ... stay at None and
    are omitted); a windowed group's BlockStored adds newer vLLM's kv_cache_spec_kind
    and kv_cache_spec_sliding_window (engine/core/kv_cache/events.py says why)."""
    if isinstance(event, BlockStored):
        wire = {"type": "BlockStored",
                "block_hashes": [external_hash(h) for h in event.block_hashes],
                "parent_block_hash": (None if event.parent_block_hash is None
                                      else external_hash(event.parent_block_hash)),
                "token_ids": event.token_ids, "block_size": event.block_size,
                "lora_id": event.lora_id, "medium": event.medium, "lora_name": event.lora_name}
        if event.extra_keys is not None:
            wire["extra_keys"] = [None if keys is None else list(keys) for keys in event.extra_keys]
        wire["group_idx"] = event.group_idx
        if event.sliding_window is not None:
            wire["kv_cache_spec_kind"] = "sliding_window"
            wire["kv_cache_spec_sliding_window"] = event.sliding_window
        return wire
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [external_hash(h) for h in event.block_hashes],
                "medium": event.medium, "group_idx": event.group_idx}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([ts, [event_to_wire(e) for e in events], data_parallel_rank],
                         use_bin_type=True)


class ZmqEventPublisher:
    """PUB socket plus replay ROUTER, served by one thread so that ZMQ sockets stay on the
    thread that made them and the engine thread only enqueues."""

    enabled = True

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self._config = config
        self._rank = data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        opening = ("endpoint", config.endpoint)
        try:
            # vLLM's convention: an address with a wildcard (or ipc/inproc) is bound, a
            # host address is connected to.
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                opening = ("replay_endpoint", config.replay_endpoint)
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A ROUTER drops what passes its send hwm without a word (ZMQ's default
                # is 1000 messages): one replay must fit whole, the buffer plus the end
                # marker, or a client that reads slower than we send loses the middle.
                self._replay.set_hwm(config.buffer_steps + 1)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_config: cannot open {opening[0]} {opening[1]!r} "
                             f"(rank {data_parallel_rank}): {exc}") from exc
        self.next_seq = 0
        self.dropped = 0  # batches refused because the queue to the thread was full
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        try:
            # The thread drains far faster than steps come (a subscriber that never reads
            # costs it nothing: PUB drops at its hwm); a full queue means the thread is
            # stuck, and the engine step must not wait on it, not even a timeout's worth.
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            if not self.dropped:
                logger.error("KV-event queue full (%d batches): dropping batches, counted in "
                             "vllm:kv_events_dropped_total", self._config.max_queue_size)
            self.dropped += 1

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every batch handed to publish() is on the wire (and in the replay
        buffer); False if that took longer than `timeout`."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                try:
                    self._answer_replay()
                except Exception:  # a malformed request must not stop publishing
                    logger.exception("KV-event replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    break
                continue
            if item is None:
                break
            ts, events = item
            try:
                payload = encode_batch(ts, events, self._rank)
                seq = self.next_seq
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.next_seq = seq + 1
            except Exception:
                logger.exception("publishing a KV-event batch failed")
            finally:
                self._queue.task_done()
        self._close_sockets()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a KV-event replay request of %d frames", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        # vLLM's _service_replay: each batch in the frames PUB sent it with, topic first.
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued (bounded by `timeout`), then close the sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)


class NullEventPublisher:
    """KV events off: the engine publishes every step without asking whether anyone listens."""

    enabled = False
    dropped = 0

    def publish(self, events: list[KVCacheEvent]) -> None:
        pass

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def shutdown(self, timeout: float = 2.0) -> None:
        pass


def make_publisher(config: KVEventsConfig | None,
                   rank: int = 0) -> ZmqEventPublisher | NullEventPublisher:
    if config is None or not config.active:
        return NullEventPublisher()
    return ZmqEventPublisher(config.for_rank(rank), data_parallel_rank=rank)
