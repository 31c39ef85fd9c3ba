"""A step's grammar masks: the allowed next tokens of its constrained rows, filled by
xgrammar and applied to the logits in place. Only constrained rows are touched."""
from __future__ import annotations

from typing import Any

import torch

from engine.structured_output.grammar import RequestGrammar, import_xgrammar


class BitmaskFiller:
    """Fills the next-token bitmasks of a step's constrained rows in one xgrammar call.

    On one thread: each row costs 5-30 us, and xgrammar's pool of 2 threads made the
    fill 1.4x slower for 8 rows and 4x for 32 on a 2-CPU host with a busy neighbour
    (torch's threads adapt to neighbours, a fixed pool does not)."""

    __slots__ = ("_batch",)

    def __init__(self) -> None:
        self._batch: Any = None

    def fill(self, grammars: list[RequestGrammar], rows: list[int], num_rows: int,
             vocab_size: int, prefixes: list[list[int] | None] | None = None) -> torch.Tensor:
        """int32 [num_rows, ceil(vocab/32)]; `rows` are filled (row i for grammars[i]).
        prefixes[i]: tokens grammars[i] accepts before row i is filled and gives back
        after (a speculative draft's row, engine/sample/draft_rows.py); None: none."""
        xgrammar = import_xgrammar()
        if self._batch is None:
            self._batch = xgrammar.BatchGrammarMatcher(1)
        bitmask = xgrammar.allocate_token_bitmask(num_rows, vocab_size)
        if prefixes is None or not any(prefixes):
            self._batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask,
                                                      rows)
            return bitmask
        plain = [i for i, prefix in enumerate(prefixes) if not prefix]
        if plain:
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in plain],
                                                      bitmask, [rows[i] for i in plain])
        for grammar, row, prefix in zip(grammars, rows, prefixes):
            if prefix:
                grammar.fill_after(prefix, bitmask, row)
        return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
    """In place: the tokens a row's grammar forbids become -inf. Bitmask row i belongs
    to logits row i; rows=None: every row.

    xgrammar's CPU kernel tests every bit of a word that is not all ones: ~5 ns a token,
    2 ms for 8 rows of a 49k vocabulary where the grammar allows a handful (after `{`,
    say), but ~20 us where it allows almost everything (inside a string). Rows that
    allow few tokens are therefore filled with -inf and get their allowed logits back
    (0.1-0.2 ms for those 8 rows); the others keep xgrammar's kernel."""
    xgrammar = import_xgrammar()
    vocab = logits.shape[1]
    if logits.is_cuda:  # xgrammar's GPU kernel is fast whatever the mask
        xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab,
                                             indices=rows)
        return
    rows = list(range(logits.shape[0])) if rows is None else rows
    words = bitmask[rows]
    few_allowed = (2 * (words != 0).sum(dim=1) < (words != -1).sum(dim=1)).tolist()
    dense = [row for row, few in zip(rows, few_allowed) if not few]
    if dense:
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=dense)
    sparse = [i for i, few in enumerate(few_allowed) if few]
    if sparse:
        _keep_allowed_only(logits, words[sparse], torch.tensor([rows[i] for i in sparse]))


def _keep_allowed_only(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    local, word = (words != 0).nonzero(as_tuple=True)
    bits = (words[local, word].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    entry, bit = bits.nonzero(as_tuple=True)
    token = word[entry] * 32 + bit
    row = rows[local[entry]]
    inside = token < logits.shape[1]  # the last word's bits past the vocabulary
    row, token = row[inside], token[inside]
    kept = logits[row, token]
    logits.index_fill_(0, rows, float("-inf"))
    logits.index_put_((row, token), kept)
