"""Stop-string matching for streamed output: one Aho-Corasick automaton per stop list.

Per new character the matcher takes one trie edge plus at most as many failure links as
it climbed edges before, so a step costs O(new chars + held-back tail) whatever the number
and length of the stop strings. For 200 stops x 1,000 chars over 4,000 chars of output the
old scan of every stop per step took 32-67 ms per step, the matcher 3-7 us at the 99th
percentile (bench/bench_stop_strings.py on the 2-core AVX2 EPYC dev host, busy neighbours).
The automaton's state also gives the hold-back length: its depth is the longest tail of
the text that is a prefix of some stop string.

A match is the stop string that ends first in the text; of several ending at the same
character, the longest. That rule does not depend on how the text was split into tokens.

Limits (`check_stop_limits` raises ValueError naming the field; the backend answers
INVALID_ARG). Figures measured on the 2-core AVX2 AMD EPYC dev host, CPython 3.11:
- MAX_STOP_STRINGS = 256: OpenAI's API takes up to 4 stop strings; 256 leaves room for
  generated word lists while bounding what one request holds.
- MAX_STOP_STRING_CHARS = 1,024 per string: a stop string is a marker or a few lines, and a
  stream may hold back up to this many characters minus one while they could begin a match.
- MAX_STOP_CHARS_TOTAL = 16,384 over all strings: building the automaton runs in Python on
  the engine thread once per request (a repeated stop list reuses a cached automaton), at
  ~1.2 us per character: 16-20 ms at this limit (up to ~45 ms with the host busy), a pause
  every stream shares; 200 x 1,000 chars took 0.23-0.5 s. 16,384 still fits 256 strings of
  64 characters or 16 of 1,024.
- MAX_STOP_TOKEN_IDS = 256: the stop checker tests each sampled token against this set
  and the sampler masks all of them while min_tokens is unmet.
- MAX_STOP_TOKEN_SEQUENCES = 256 id sequences of at most MAX_STOP_SEQUENCE_IDS = 256 ids,
  MAX_STOP_SEQUENCE_IDS_TOTAL = 4,096 ids in all (the token path's stop words): a new
  token is compared with the sequences ending in it, at worst every id of every one.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import lru_cache

MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_CHARS_TOTAL = 16384
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_TOKEN_SEQUENCES = 256
MAX_STOP_SEQUENCE_IDS = 256
MAX_STOP_SEQUENCE_IDS_TOTAL = 4096


def check_stop_limits(stop: Sequence[str], stop_token_ids: Sequence[int],
                      stop_token_sequences: Sequence[Sequence[int]] = ()) -> None:
    """Raises ValueError naming the field when a request's stop lists exceed the limits."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most "
                         f"{MAX_STOP_STRINGS} are allowed")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"SamplingParams.stop has a string of {longest} characters; at most "
                         f"{MAX_STOP_STRING_CHARS} are allowed")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_CHARS_TOTAL:
        raise ValueError(f"SamplingParams.stop has {total} characters in all; at most "
                         f"{MAX_STOP_CHARS_TOTAL} are allowed")
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"SamplingParams.stop_token_ids has {len(stop_token_ids)} ids; at most "
                         f"{MAX_STOP_TOKEN_IDS} are allowed")
    sequences = stop_token_sequences
    if len(sequences) > MAX_STOP_TOKEN_SEQUENCES:
        raise ValueError(f"SamplingParams.stop_token_sequences has {len(sequences)} sequences; "
                         f"at most {MAX_STOP_TOKEN_SEQUENCES} are allowed")
    if any(len(q) > MAX_STOP_SEQUENCE_IDS for q in sequences):
        raise ValueError(f"SamplingParams.stop_token_sequences has a sequence over "
                         f"{MAX_STOP_SEQUENCE_IDS} ids")
    if sum(len(q) for q in sequences) > MAX_STOP_SEQUENCE_IDS_TOTAL:
        raise ValueError(f"SamplingParams.stop_token_sequences has over "
                         f"{MAX_STOP_SEQUENCE_IDS_TOTAL} ids in all")


class StopAutomaton:
    """Trie of the stop strings with failure links; read-only once built, so shareable.

    Node 0 is the root. A node's first child is stored as (owner, first): the child's
    character is stops[owner][depth], so the long unbranched runs of a stop string cost
    five array slots per node and no dict; other children live in `more`."""

    __slots__ = ("stops", "depth", "owner", "first", "more", "fail", "match_len")

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.depth = array("i", [0])
        self.owner = array("i", [-1])  # stop string that spells the first child's character
        self.first = array("i", [-1])
        self.more: dict[int, dict[str, int]] = {}
        # Length of the longest stop string ending at this node (0: none), so a match costs
        # one look-up instead of a walk along the failure links.
        self.match_len = array("i", [0])
        for index, stop in enumerate(self.stops):
            self._insert(index, stop)
        self.fail = array("i", bytes(4 * len(self.depth)))
        self._link()

    def child(self, node: int, char: str) -> int:
        """The node reached from `node` by `char` along a trie edge, or -1."""
        owner = self.owner[node]
        if owner >= 0 and self.stops[owner][self.depth[node]] == char:
            return self.first[node]
        more = self.more.get(node)
        return -1 if more is None else more.get(char, -1)

    def _insert(self, index: int, stop: str) -> None:
        node, at = 0, 0
        while at < len(stop) and (nxt := self.child(node, stop[at])) >= 0:
            node, at = nxt, at + 1
        if at < len(stop):
            start = len(self.depth)  # the rest of the stop string: a chain of new nodes
            if self.owner[node] < 0:
                self.owner[node], self.first[node] = index, start
            else:
                self.more.setdefault(node, {})[stop[at]] = start
            count = len(stop) - at
            self.depth.extend(range(at + 1, len(stop) + 1))
            self.owner.extend(array("i", [index]) * (count - 1))
            self.owner.append(-1)
            self.first.extend(range(start + 1, start + count))
            self.first.append(-1)
            self.match_len.frombytes(bytes(4 * count))
            node = len(self.depth) - 1
        if stop:
            self.match_len[node] = len(stop)

    def _link(self) -> None:
        # Breadth-first: a node's failure link is shallower than the node, so already set.
        # Inlined child(): this loop runs once per trie node, so it bounds the build time.
        stops, depth, owner, first, more = self.stops, self.depth, self.owner, self.first, self.more
        fail, match_len = self.fail, self.match_len
        nodes, chars = [0], [""]  # the queue: each node with the character that leads to it
        for node, char in zip(nodes, chars):  # zip reads the lists as they grow
            if depth[node] > 1:
                link = fail[node]  # the parent's link, parked here by the parent
                while True:
                    own = owner[link]
                    if own >= 0 and stops[own][depth[link]] == char:
                        link = first[link]
                        break
                    others = more.get(link)
                    if others is not None and char in others:
                        link = others[char]
                        break
                    if not link:
                        break
                    link = fail[link]
                fail[node] = link
                if not match_len[node]:
                    match_len[node] = match_len[link]
            parked = fail[node]
            own = owner[node]
            if own >= 0:
                nodes.append(first[node])
                chars.append(stops[own][depth[node]])
                fail[first[node]] = parked
            others = more.get(node)
            if others is not None:
                for edge_char, child in others.items():
                    nodes.append(child)
                    chars.append(edge_char)
                    fail[child] = parked


@lru_cache(maxsize=16)
def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    # Clients tend to send the same stop list with every request; hashing and comparing the
    # tuple is C-speed, building is Python-speed.
    return StopAutomaton(stops)


class StopMatcher:
    """One request's position in the automaton; fed each new piece of text once."""

    __slots__ = ("automaton", "state")

    def __init__(self, stops: Sequence[str]) -> None:
        self.automaton = automaton_for(tuple(stops))
        self.state = 0

    @property
    def partial_len(self) -> int:
        """Length of the longest tail of the text fed so far that begins a stop string."""
        return self.automaton.depth[self.state]

    def feed(self, text: str, start: int) -> tuple[int, int] | None:
        """Advances over text[start:]; returns (start, end) of the first stop string that
        ends there (longest at that end), or None. After a match the matcher is spent."""
        auto = self.automaton
        stops, depth, owner, first, more = auto.stops, auto.depth, auto.owner, auto.first, auto.more
        fail, match_len = auto.fail, auto.match_len
        state = self.state
        for at in range(start, len(text)):
            char = text[at]
            while True:  # inlined StopAutomaton.child: this loop is the per-character cost
                own = owner[state]
                if own >= 0 and stops[own][depth[state]] == char:
                    state = first[state]
                    break
                others = more.get(state)
                if others is not None and char in others:
                    state = others[char]
                    break
                if not state:
                    break
                state = fail[state]
            if match_len[state]:
                self.state = state
                return at + 1 - match_len[state], at + 1
        self.state = state
        return None
