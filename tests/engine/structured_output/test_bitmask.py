"""engine.structured_output.bitmask: applying the grammars' token bitmasks to the logits,
bit-equal to xgrammar's own kernel."""
import pytest
import torch

from engine.structured_output.bitmask import apply_bitmask


@pytest.mark.parametrize("vocab", [1000, 1024])
@pytest.mark.parametrize("seed", range(4))
def test_bitmask_application_equals_xgrammars_kernel(vocab, seed):
    """Rows that allow few tokens take the fill-and-restore path, the others xgrammar's
    kernel; both must give exactly what the kernel gives on every row."""
    import xgrammar

    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31, (6, words), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # allows everything
    bitmask[1, :] = 0  # allows one token
    bitmask[1, 5] = 1 << 3
    bitmask[2, torch.rand(words, generator=gen) < 0.9] = -1  # mostly allowed
    bitmask[3, torch.rand(words, generator=gen) < 0.95] = 0  # mostly forbidden
    bitmask[4, -1] = -1  # the bits past the vocabulary are set
    bitmask[4, : words - 1] = 0
    logits = torch.randn(6, vocab, generator=gen)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 3, 4], [5]):
        want = logits.clone()
        xgrammar.apply_token_bitmask_inplace(want, bitmask, vocab_size=vocab, indices=rows)
        got = logits.clone()
        apply_bitmask(got, bitmask, rows)
        assert torch.equal(got, want)
    got = logits.clone()
    apply_bitmask(got, bitmask, None)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    assert torch.equal(got, logits)
