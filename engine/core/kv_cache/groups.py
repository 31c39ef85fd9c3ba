"""KV-cache groups: which layers share a block table (vLLM V1's hybrid KV-cache grouping).

Layers are sorted by attention kind (full, or a sliding window of W tokens). A model of
one kind (Llama: all full; Mistral v0.1: all windowed) has one group of every layer. A
hybrid model (Gemma 2 alternates, Gemma 3 has 5 windowed layers per full one) has
several groups of `group_size` layers each, vLLM's rule: the size is the smallest kind's
layer count (or the largest's when they are within 25% of each other), the larger kinds
are cut into groups of that size in layer order, and a kind's last group may be short
(its missing layers are padding: their bytes exist but no layer uses them).

Every group draws its blocks from the one BlockPool, so a block id must mean the same
bytes whatever group holds it: the KV cache is `group_size` "slot" tensors of
[num_blocks, block_size, kv_heads, head_dim] (K and V), and layer l keeps its K/V in the
slot of its index within its group, addressed through its group's block table. One block
therefore costs group_size layers' K and V. With one group, slot l is layer l: today's
layout, a tensor per layer.

Torch-free: the scheduler side builds the same layout as the model runner."""
from __future__ import annotations

from typing import Sequence

# vLLM's: kinds whose layer counts are this close share one group size, the largest,
# rather than cutting the larger kind into a group and a mostly padded one.
_CLOSE_COUNTS = 1.25


class KVCacheGroup:
    """Layers with one block table: `layers` (model layer indices, ascending; the i-th is
    slot i of a block) and their `window` (None: full attention)."""

    __slots__ = ("layers", "window")

    def __init__(self, layers: Sequence[int], window: int | None) -> None:
        self.layers = tuple(layers)
        self.window = window

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, KVCacheGroup) and self.layers == other.layers
                and self.window == other.window)

    def __repr__(self) -> str:
        kind = "full" if self.window is None else f"window={self.window}"
        return f"KVCacheGroup({kind}, layers={list(self.layers)})"


class KVCacheLayout:
    """The groups of a model, with each layer's group and slot looked up once."""

    __slots__ = ("groups", "group_size", "num_layers", "layer_group", "layer_slot", "windows")

    def __init__(self, groups: Sequence[KVCacheGroup], group_size: int) -> None:
        self.groups = tuple(groups)
        self.group_size = group_size
        self.num_layers = sum(len(g.layers) for g in self.groups)
        group_of, slot_of = [0] * self.num_layers, [0] * self.num_layers
        for index, group in enumerate(self.groups):
            if not 0 < len(group.layers) <= group_size:
                raise ValueError(f"KV-cache group {index} has {len(group.layers)} layers, "
                                 f"group size {group_size}")
            for slot, layer in enumerate(group.layers):
                group_of[layer], slot_of[layer] = index, slot
        if sorted(l for g in self.groups for l in g.layers) != list(range(self.num_layers)):
            raise ValueError("KV-cache groups must hold every layer exactly once")
        self.layer_group = tuple(group_of)
        self.layer_slot = tuple(slot_of)
        self.windows = tuple(g.window for g in self.groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its group's window: what build_layout rebuilds this layout from."""
        return tuple(self.windows[g] for g in self.layer_group)

    @property
    def has_window(self) -> bool:
        return any(w is not None for w in self.windows)

    def peak_blocks(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` holds at once, all groups together,
        when no step gives it more than `max_chunk` tokens."""
        return sum(group_peak_blocks(w, num_tokens, block_size, max_chunk) for w in self.windows)

    def __repr__(self) -> str:
        return f"KVCacheLayout(group_size={self.group_size}, groups={list(self.groups)})"


def group_peak_blocks(window: int | None, num_tokens: int, block_size: int,
                      max_chunk: int) -> int:
    """The most blocks a request of `num_tokens` holds at once in one group. Full
    attention: all of them. A window W: a step that computes c <= max_chunk tokens from
    position p holds the blocks of positions p - W + 1 .. p + c - 1 (those before are
    freed first), which span at most (W + c - 2) // block_size + 2 blocks."""
    every = -(-num_tokens // block_size)
    if window is None:
        return every
    return min(every, (window + max_chunk - 2) // block_size + 2)


def build_layout(windows: Sequence[int | None]) -> KVCacheLayout:
    """Groups for a model whose layer l attends through `windows[l]` (None: full)."""
    if not windows:
        raise ValueError("a model needs at least one layer")
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        if window is not None and window < 1:
            raise ValueError(f"layer {layer}: sliding window must be >= 1, got {window}")
        by_kind.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in by_kind.values()]
    if len(by_kind) == 1:
        group_size = counts[0]
    else:
        group_size = min(counts)
        if max(counts) < min(counts) * _CLOSE_COUNTS:
            group_size = max(counts)
    # Kinds in the order of their first layer (vLLM's), so group 0 is the first layer's.
    groups = [KVCacheGroup(layers[start:start + group_size], window)
              for window, layers in by_kind.items()
              for start in range(0, len(layers), group_size)]
    return KVCacheLayout(groups, group_size)


def full_attention_layout(num_layers: int) -> KVCacheLayout:
    """One group of every layer, no window: the layout of a model without windows."""
    return build_layout([None] * num_layers)
