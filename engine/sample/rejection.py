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
uniform, so a seeded request sees other, equally distributed tokens).

A draft model's probabilistic drafts are not one-hot: accept_with_probs weighs them with
the draft's own probabilities."""
from __future__ import annotations

import torch


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


def accept_with_probs(target: torch.Tensor, draft: torch.Tensor, drafts: list[int],
                      bonus: int, generator: torch.Generator) -> list[int]:
    """vLLM's rejection sampling for drafts with probabilities (a draft model's draws):
    draft x at position j is kept with probability min(1, p_j(x) / q_j(x)); at the first
    rejection the token is drawn from max(p_j - q_j, 0), renormalised, and the rest
    dropped; all kept, `bonus` (the target's own draw after them) follows. `target` p and
    `draft` q: [len(drafts), vocab] probabilities. The output is distributed as tokens
    drawn from p one at a time (Leviathan et al., 2023)."""
    uniforms = torch.rand(len(drafts), generator=generator, device=target.device).tolist()
    out: list[int] = []
    for j, token in enumerate(drafts):
        p, q = float(target[j, token]), float(draft[j, token])
        if uniforms[j] * q < p:  # u < p / q, also where q == 0 cannot happen (x came from q)
            out.append(token)
            continue
        residual = (target[j] - draft[j]).clamp_(min=0)
        total = float(residual.sum())
        if not total > 0:  # p == q up to rounding: a rejection cannot really happen
            residual, total = target[j], float(target[j].sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=generator)))
        return out
    out.append(bonus)
    return out
