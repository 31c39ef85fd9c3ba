"""Sampler semantics: greedy, truncation, seeds, penalties, min_tokens, logprobs."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.sample.sampler import Sampler, apply_penalties
from engine.sample.metadata import SamplingMetadata

pytestmark = pytest.mark.timeout(120)


def make_request(rid, params, prompt=(1, 2, 3), outputs=(), eos=None):
    req = Request(str(rid), list(prompt), params, eos_token_id=eos)
    for tok in outputs:
        req.all_token_ids.append(tok)
    return req


def sample(sampler, logits, requests):
    md = sampler.prepare(requests, logits.shape[1], logits.device)
    return sampler(logits, md)


def sample_rows(logits_row, params, rows, seed=0):
    """The same logits on `rows` rows: one sampler call gives `rows` independent draws."""
    sampler = Sampler(seed=seed)
    reqs = [make_request(i, params) for i in range(rows)]
    return sample(sampler, logits_row.expand(rows, -1).clone(), reqs).sampled_token_ids


def test_all_greedy_batch_is_argmax_fast_path():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    reqs = [make_request(i, SamplingParams(temperature=0.0)) for i in range(5)]
    sampler = Sampler()
    md = sampler.prepare(reqs, 40, "cpu")
    assert md.argmax_only
    out = sampler(logits, md)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_logprobs is None and out.topk_token_ids is None


def test_greedy_rows_inside_random_batch_stay_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5)] * 3
    out = sample(Sampler(seed=3), logits, [make_request(i, p) for i, p in enumerate(params)])
    assert torch.equal(out.sampled_token_ids[::2], logits[::2].argmax(dim=-1))


def test_top_k_1_equals_greedy():
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(4))
    reqs = [make_request(i, SamplingParams(temperature=1.3, top_k=1)) for i in range(64)]
    out = sample(Sampler(seed=5), logits, reqs)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_support_is_exactly_the_k_largest():
    row = torch.randn(1, 30, generator=torch.Generator().manual_seed(6))
    got = set(sample_rows(row, SamplingParams(temperature=5.0, top_k=4), 2000).tolist())
    assert got == set(row[0].topk(4).indices.tolist())


def test_sampling_frequencies_follow_softmax_with_temperature():
    row = torch.tensor([[1.0, 0.0, -1.0, 2.0, 0.5]])
    drawn = sample_rows(row, SamplingParams(temperature=2.0), 20000, seed=7)
    freq = torch.bincount(drawn, minlength=5).double() / drawn.numel()
    expected = torch.softmax(row[0].double() / 2.0, dim=0)
    assert torch.allclose(freq, expected, atol=0.015)


def nucleus(probs: np.ndarray, p: float) -> set[int]:
    """Tokens whose higher-ranked mass is < p; tokens tied with the last one stay too."""
    order = np.argsort(-probs, kind="stable")
    above = np.cumsum(probs[order]) - probs[order]
    cutoff = probs[order][above < p].min()
    return set(np.flatnonzero(probs >= cutoff).tolist())


@pytest.mark.parametrize("scale,vocab", [(6.0, 1000), (0.1, 1000), (2.0, 40)])
def test_top_p_samples_stay_in_the_nucleus(scale, vocab):
    # scale 0.1 over 1000 tokens puts the nucleus beyond the top candidates (the sort fallback).
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)) * scale
    probs = torch.softmax(row[0].double(), 0).numpy()
    allowed = nucleus(probs, 0.8)
    got = set(sample_rows(row, SamplingParams(temperature=1.0, top_p=0.8), 3000).tolist())
    assert got <= allowed
    # Nothing legitimate is cut off: the heaviest few nucleus tokens all show up.
    assert set(np.argsort(-probs)[:3].tolist()) <= got


def test_min_p_drops_tokens_below_threshold():
    row = torch.tensor([[3.0, 2.9, 1.0, 0.5, -2.0, 2.0]])
    probs = torch.softmax(row[0], 0)
    got = set(sample_rows(row, SamplingParams(temperature=1.0, min_p=0.3), 3000).tolist())
    assert got == {i for i in range(6) if probs[i] >= 0.3 * probs.max()}


def reference_allowed(logits, temperature, top_k, top_p, min_p, slack=1e-4):
    """Tokens the sampler may return (float64, a little slack at the top-p/min-p borders)."""
    x = logits.astype(np.float64) / temperature
    keep = x >= x.max() + np.log(min_p * (1 - slack)) if min_p > 0 else np.ones_like(x, bool)
    if 0 < top_k < len(x):
        keep &= x >= np.sort(x)[-top_k]
    if top_p < 1.0:
        w = np.where(keep, np.exp(x - x.max()), 0.0)
        probs = w / w.sum()
        keep &= np.isin(np.arange(len(x)), list(nucleus(probs, top_p + slack)))
    return set(np.flatnonzero(keep).tolist())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-40, 40), min_size=2, max_size=60), st.floats(0.2, 3.0),
       st.integers(0, 8), st.floats(0.05, 1.0), st.floats(0.0, 0.5), st.integers(0, 2**31 - 1))
def test_property_sample_respects_all_truncations(values, temperature, top_k, top_p, min_p, seed):
    logits = np.array(values, dtype=np.float32) / 4
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    drawn = sample_rows(torch.from_numpy(logits)[None], params, 16, seed=seed)
    assert set(drawn.tolist()) <= reference_allowed(logits, temperature, top_k, top_p, min_p)


def run_steps(sampler, requests, logits_per_step, watch):
    """Samples several steps, appending each sampled token; returns what `watch` got."""
    got = []
    for logits in logits_per_step:
        out = sample(sampler, logits[:len(requests)], requests)
        for req, tok in zip(requests, out.sampled_token_ids.tolist()):
            req.all_token_ids.append(tok)
        got.append(out.sampled_token_ids[requests.index(watch)].item())
    return got


def test_seeded_request_is_reproducible_alone_and_in_any_batch():
    vocab = 64
    base = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def steps_for(batch_logits_seed, others, position):
        reqs = [make_request(f"o{i}", SamplingParams(temperature=1.0, seed=i if i % 2 else None))
                for i in range(others)]
        me = make_request("me", seeded)
        reqs.insert(position, me)
        gen = torch.Generator().manual_seed(batch_logits_seed)
        per_step = []
        for step in range(4):
            logits = torch.randn(len(reqs), vocab, generator=gen)
            logits[position] = base[step]  # the seeded row sees the same logits everywhere
            per_step.append(logits)
        return run_steps(Sampler(seed=batch_logits_seed), reqs, per_step, me)

    alone = steps_for(0, 0, 0)
    assert steps_for(1, 3, 2) == alone
    assert steps_for(2, 5, 0) == alone
    assert steps_for(3, 2, 2) == alone


def test_free_restarts_the_seeded_generator():
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    req = make_request("r", SamplingParams(temperature=1.0, seed=99))
    first = [sample(sampler, logits, [req]).sampled_token_ids.item() for _ in range(3)]
    assert len(set(first)) > 1  # uniform over 1000 tokens: the generator advances
    sampler.free("r")
    again = [sample(sampler, logits, [req]).sampled_token_ids.item() for _ in range(3)]
    assert again == first


def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                            presence_penalty=0.25)
    req = make_request("p", params, prompt=[0, 1], outputs=[2, 2, 4])
    md = SamplingMetadata.build([req], 6, "cpu")
    got = apply_penalties(logits.clone(), md.penalties)
    # rep: seen {0,1,2,4}: 2/2, -1*2, 0.5/2, -, 1/2 ; then -0.5*count - 0.25*[count>0]
    expected = torch.tensor([[1.0, -2.0, 0.25 - 1.0 - 0.25, -3.0, 0.5 - 0.5 - 0.25, 0.0]])
    assert torch.allclose(got, expected)


def test_penalty_rows_do_not_touch_other_rows_and_change_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    reqs = [make_request("a", SamplingParams(temperature=0.0, frequency_penalty=2.0),
                         outputs=[0]),
            make_request("b", SamplingParams(temperature=0.0), outputs=[0])]
    out = sample(Sampler(), logits, reqs)
    assert out.sampled_token_ids.tolist() == [1, 0]


def test_cached_output_ids_track_growth_across_steps():
    sampler = Sampler()
    req = make_request("g", SamplingParams(temperature=0.0, frequency_penalty=1.0))
    gen = torch.Generator().manual_seed(10)
    for _ in range(150):  # past the cache's initial capacity
        req.all_token_ids.append(int(torch.randint(0, 20, (1,), generator=gen)))
        cached = sampler.prepare([req], 20, "cpu").penalties
        fresh = SamplingMetadata.build([req], 20, "cpu").penalties
        assert torch.equal(apply_penalties(torch.zeros(1, 20), cached),
                           apply_penalties(torch.zeros(1, 20), fresh))
    counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=20).float()
    assert torch.equal(apply_penalties(torch.zeros(1, 20), cached), -counts[None])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 7, 3
    logits = torch.zeros(1, 10)
    logits[0, eos], logits[0, stop], logits[0, 5] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[stop])
    req = make_request("m", params, eos=eos)
    sampler = Sampler()
    assert sample(sampler, logits, [req]).sampled_token_ids.item() == 5
    req.all_token_ids.append(5)
    assert sample(sampler, logits, [req]).sampled_token_ids.item() == 5
    req.all_token_ids.append(5)
    assert sample(sampler, logits, [req]).sampled_token_ids.item() == eos


def test_min_tokens_with_ignore_eos_leaves_eos_alone():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    req = make_request("i", SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), eos=1)
    assert sample(Sampler(), logits, [req]).sampled_token_ids.item() == 1


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(11))
    reqs = [make_request(0, SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5)),
            make_request(1, SamplingParams(temperature=0.0, logprobs=0)),
            make_request(2, SamplingParams(temperature=1.0))]
    out = sample(Sampler(seed=12), logits, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    assert torch.allclose(out.sampled_logprobs, ref.gather(1, sampled[:, None]).squeeze(1))
    top = ref.topk(3, dim=-1)
    assert torch.equal(out.topk_token_ids, top.indices)
    assert torch.allclose(out.topk_logprobs, top.values)


def test_sampled_token_rank_counts_the_vocab_at_or_above_it():
    """vLLM's rank (v1/sample/ops/logprobs.py batched_count_greater_than): how many of the
    row's logprobs are >= the sampled token's, so the argmax is 1."""
    logits = torch.randn(64, 40, generator=torch.Generator().manual_seed(5))
    reqs = [make_request(i, SamplingParams(temperature=0.0 if i == 0 else 3.0, logprobs=0))
            for i in range(64)]
    out = sample(Sampler(seed=9), logits, reqs)
    ref = torch.log_softmax(logits, dim=-1)
    chosen = ref.gather(1, out.sampled_token_ids[:, None])
    assert torch.equal(out.sampled_ranks, (ref >= chosen).sum(dim=-1))
    assert out.sampled_ranks[0] == 1
    assert out.sampled_ranks.max() > 1  # hot rows pick tokens other than the argmax


def test_logprobs_absent_unless_asked_and_topk_absent_for_zero():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(13))
    plain = sample(Sampler(), logits, [make_request(i, SamplingParams()) for i in range(2)])
    assert plain.sampled_logprobs is None and plain.topk_logprobs is None
    zero = sample(Sampler(), logits, [make_request(0, SamplingParams(logprobs=0)),
                                      make_request(1, SamplingParams())])
    assert zero.sampled_logprobs is not None and zero.topk_token_ids is None


def test_min_tokens_masks_every_eos_id():
    # generation_config may list several EOS ids; none may end the output early.
    logits = torch.zeros(1, 10)
    logits[0, 7], logits[0, 4], logits[0, 5] = 10.0, 9.0, 8.0
    req = make_request("e", SamplingParams(temperature=0.0, min_tokens=1), eos=[7, 4])
    assert sample(Sampler(), logits, [req]).sampled_token_ids.item() == 5
    req.all_token_ids.append(5)
    assert sample(Sampler(), logits, [req]).sampled_token_ids.item() == 7


def test_top_p_below_float32_resolution_keeps_only_the_top_token():
    # 1e-46 is 0.0 in float32; the nucleus once gathered index -1 and failed the batch.
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(14))
    reqs = [make_request(i, SamplingParams(temperature=1.0, top_p=p))
            for i, p in enumerate([1e-46, 5e-324, 1e-38, 1e-7] * 2)]
    out = sample(Sampler(seed=15), logits, reqs)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


EXTREME_BUT_VALID = [
    SamplingParams(temperature=1e300, min_tokens=4, top_p=0.9),  # inf in float32
    SamplingParams(temperature=1e-5, top_k=1_000_000_000),
    SamplingParams(temperature=1.0, min_p=1e-46, top_p=1e-46),
    SamplingParams(temperature=0.5, repetition_penalty=1e-300, min_tokens=3),  # 0 in float32
    SamplingParams(temperature=2.0, repetition_penalty=1e300, top_k=3, logprobs=2),
    SamplingParams(temperature=1.0, seed=2**64 - 1, min_p=1.0),
    SamplingParams(temperature=1.0, seed=-2**63, presence_penalty=-2, frequency_penalty=2),
    SamplingParams(temperature=0.0, repetition_penalty=1e-300),
]


def test_extreme_valid_parameters_sample_in_range_and_leave_other_rows_alone():
    vocab = 64
    logits = torch.randn(len(EXTREME_BUT_VALID) + 2, vocab,
                         generator=torch.Generator().manual_seed(16)) * 5
    logits[:, :2] = 0.0  # exact zeros: 0 * inf is nan
    seeded_params = SamplingParams(temperature=1.0, top_p=0.9, seed=77)
    reqs = [make_request(i, p, outputs=[0, 1, 2], eos=[2, 3])
            for i, p in enumerate(EXTREME_BUT_VALID)]
    reqs += [make_request("greedy", SamplingParams(temperature=0.0)),
             make_request("seeded", seeded_params)]
    batch_sampler, alone_sampler = Sampler(seed=1), Sampler(seed=2)
    alone_req = make_request("seeded", seeded_params)
    for _ in range(3):  # the seeded row's generator advances alike in the batch and alone
        got = sample(batch_sampler, logits, reqs).sampled_token_ids
        alone = sample(alone_sampler, logits[-1:], [alone_req]).sampled_token_ids
        assert ((got >= 0) & (got < vocab)).all()
        assert got[-2].item() == logits[-2].argmax().item()
        assert got[-1].item() == alone.item()


def test_a_row_that_breaks_sampling_is_named_and_fails_alone():
    from engine.sample.sampler import SamplingError

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(17))
    good = [make_request("a", SamplingParams(temperature=1.0, top_k=5)),
            make_request("c", SamplingParams(temperature=0.0))]
    # A value validation let through (set after it ran): top_k 0.5 becomes a k of 0.
    bad_params = SamplingParams(temperature=1.0, top_k=5)
    bad_params.top_k = 0.5
    bad = make_request("b", bad_params)
    sampler = Sampler()
    with pytest.raises(SamplingError) as info:
        sample(sampler, logits, [good[0], bad, good[1]])
    assert info.value.failed_request_ids == ["b"]
    # A seed torch refuses fails while preparing, before any generator advances.
    huge_seed = SamplingParams(temperature=1.0, seed=5)
    huge_seed.seed = 2**70
    with pytest.raises(SamplingError) as info:
        sampler.prepare([good[0], make_request("s", huge_seed), good[1]], 50, "cpu")
    assert info.value.failed_request_ids == ["s"]
    # The same sampler then serves the good rows as if nothing happened.
    out = sample(sampler, logits[[0, 2]], good)
    assert out.sampled_token_ids[1].item() == logits[2].argmax().item()
