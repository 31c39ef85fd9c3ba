"""A KV-event subscriber's view of one engine's prefix cache, rebuilt from the wire alone,
as a prefix-aware router's indexer keeps it (llm-d's KV indexer, Dynamo's KV router): the
set of block keys the engine can hit, and per prompt how many leading blocks it holds.

Reads vLLM's batch layout [ts, events, data_parallel_rank], each event a map tagged by
"type" (engine/core/kv_cache/publisher.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    import msgpack

    batch = msgpack.unpackb(payload, raw=False)
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise ValueError(f"not a KV-event batch: {type(batch).__name__}")
    ts, events = batch[0], batch[1]
    return ts, events, batch[2] if len(batch) == 3 else None


@dataclass
class KVEventIndex:
    """Block keys one engine holds, updated batch by batch in sequence order."""
    keys: set[int | bytes] = field(default_factory=set)
    next_seq: int = 0
    num_batches: int = 0

    def apply_events(self, events: Iterable[dict[str, Any]]) -> None:
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                self.keys.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                self.keys.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self.keys.clear()
            else:
                raise ValueError(f"unknown KV event type {kind!r}")
        self.num_batches += 1

    def apply(self, seq: int, payload: bytes) -> None:
        """One published message. A gap in the sequence means lost batches: the index
        would silently diverge, so it refuses (replay the gap first)."""
        if seq != self.next_seq:
            raise ValueError(f"KV-event sequence gap: expected {self.next_seq}, got {seq}")
        self.apply_events(decode_batch(payload)[1])
        self.next_seq = seq + 1

    def prefix_hits(self, prompt_keys: list[int | bytes]) -> int:
        """Leading blocks of a prompt (its chained keys) this engine holds."""
        hits = 0
        for key in prompt_keys:
            if key not in self.keys:
                break
            hits += 1
        return hits
