"""Verification of drafts (engine/sample/rejection.py) keeps the target distribution:
over many seeded draws at temperature 1 the first token is distributed as the target's
first row, and, given the draft was kept, the second as its second row. A chi-square
statistic against each row's probabilities must stay under the 0.1% critical value.
One-hot drafts (n-gram, suffix, a greedy draft model) and drafts with probabilities (a
probabilistic draft model) each; verifiers that keep drafts regardless, or ignore the
draft's probabilities, fail the same test."""
import torch

from engine.core.request import Request
from engine.sample.draft_rows import expand_rows
from engine.sample.rejection import accept_one_hot, accept_with_probs
from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams

VOCAB = 8
# Critical values of chi-square at p = 0.001 for 7 degrees of freedom (VOCAB - 1).
CRITICAL_7DF = 24.32
DRAWS = 3000


def target_logits():
    generator = torch.Generator().manual_seed(5)
    return torch.randn(2, VOCAB, generator=generator) * 1.5


def chi_square(counts: list[int], probs: torch.Tensor) -> float:
    total = sum(counts)
    expected = probs * total
    return float(((torch.tensor(counts, dtype=torch.float64) - expected) ** 2 / expected).sum())


def draw(verify, draft: int):
    logits = target_logits()
    sampler = Sampler(seed=0)
    request = Request("r", [1, 2, 3], SamplingParams(temperature=1.0, seed=11))
    firsts, seconds = [0] * VOCAB, [0] * VOCAB
    for _ in range(DRAWS):
        rows = expand_rows([request], {"r": [draft]})
        sampled = sampler(logits.clone(), sampler.prepare(rows, VOCAB, "cpu"))
        tokens = verify(sampled.sampled_token_ids.tolist(), draft)
        firsts[tokens[0]] += 1
        if len(tokens) == 2:
            seconds[tokens[1]] += 1
    probs = torch.softmax(logits.double(), dim=-1)
    return chi_square(firsts, probs[0]), chi_square(seconds, probs[1]), firsts


def test_one_hot_drafts_keep_the_target_distribution():
    probs = torch.softmax(target_logits().double(), dim=-1)
    # A draft the target finds likely, so both rows see many draws.
    draft = int(probs[0].argmax())
    first, second, firsts = draw(lambda sampled, d: accept_one_hot(sampled, 0, [d]), draft)
    assert first < CRITICAL_7DF and second < CRITICAL_7DF
    assert 0 < firsts[draft] < DRAWS


def test_keeping_every_draft_fails_the_same_test():
    probs = torch.softmax(target_logits().double(), dim=-1)
    draft = int(probs[0].argmin())
    first, _, _ = draw(lambda sampled, d: [d, sampled[1]], draft)
    assert first > CRITICAL_7DF


def draft_distribution():
    generator = torch.Generator().manual_seed(9)
    return torch.softmax(torch.randn(VOCAB, generator=generator, dtype=torch.float64), dim=-1)


def verify_draws(verify):
    """First tokens of DRAWS verifications of a draft drawn from q against p."""
    p = torch.softmax(target_logits().double(), dim=-1)
    q = draft_distribution()
    generator = torch.Generator().manual_seed(3)
    firsts, kept = [0] * VOCAB, 0
    for _ in range(DRAWS):
        draft = int(torch.multinomial(q, 1, generator=generator))
        bonus = int(torch.multinomial(p[1], 1, generator=generator))
        tokens = verify(p[:1], q.unsqueeze(0), [draft], bonus, generator)
        firsts[tokens[0]] += 1
        kept += len(tokens) == 2
    return chi_square(firsts, p[0]), kept


def test_drafts_with_probabilities_keep_the_target_distribution():
    statistic, kept = verify_draws(accept_with_probs)
    assert statistic < CRITICAL_7DF
    # Kept with probability sum(min(p, q)), not sum(p * q) as a one-hot test of the same
    # draws would: the point of verifying with the draft's probabilities.
    p = torch.softmax(target_logits().double(), dim=-1)[0]
    q = draft_distribution()
    assert abs(kept / DRAWS - float(torch.minimum(p, q).sum())) < 0.03
    assert kept / DRAWS > float((p * q).sum()) + 0.1


def test_a_verifier_that_ignores_the_drafts_probabilities_fails():
    """Keeps a draft with probability min(1, p / q) but resamples from p on a rejection
    (the residual max(p - q, 0) ignored): biased towards what the draft likes."""
    def careless(target, draft, drafts, bonus, generator):
        token = drafts[0]
        if float(torch.rand(1, generator=generator)) * float(draft[0, token]) < float(target[0, token]):
            return [token, bonus]
        return [int(torch.multinomial(target[0], 1, generator=generator))]

    statistic, _ = verify_draws(careless)
    assert statistic > CRITICAL_7DF
