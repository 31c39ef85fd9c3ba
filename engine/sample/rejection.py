"""Which proposed tokens a step keeps (speculative decoding's verification).

Drafts from n-gram and suffix proposers are one-hot: the proposer puts all its
probability on one token. vLLM's rejection sampler then accepts draft d at a position
with probability p(d) (p: the target's distribution there, after temperature, top-k/p,
penalties and the grammar's mask) and, on rejection, samples from p with d removed,
renormalised. Sampling t ~ p and keeping d exactly when t == d does the same: P(keep) =
p(d), and a t != d is distributed as p restricted to the other tokens. So each row is
sampled as an ordinary step would sample it (engine/sample/draft_rows.py builds the
rows), and the output is the longest prefix of drafts equal to the samples, then the
sample at the first disagreement, or after all k the sample of row k + 1 (the "bonus"
token). Greedy rows give exactly greedy decoding's tokens; random rows keep the target
distribution, with other draws than without speculation (each row draws its own
uniform, so a seeded request sees other, equally distributed tokens)."""
from __future__ import annotations


def accept_one_hot(sampled: list[int], start: int, drafts: list[int]) -> list[int]:
    """`sampled[start:start + len(drafts) + 1]` are the request's rows; returns its tokens."""
    out: list[int] = []
    for offset, draft in enumerate(drafts):
        token = sampled[start + offset]
        out.append(token)
        if token != draft:
            return out
    out.append(sampled[start + len(drafts)])
    return out
