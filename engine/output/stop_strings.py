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
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import lru_cache

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
