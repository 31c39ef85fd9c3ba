"""bench/bench_spec_decode.py: --quick parts 1-2 print a row per variant with every
column and the targets (speed is never asserted); the copy workload's prompts are distinct;
part 3's proposer drafts the recorded continuation with the forced share right."""
from types import SimpleNamespace

import pytest

from bench import bench_spec_decode as bench


def test_copy_prompts_are_distinct_and_quote_their_passage():
    texts = bench.copy_texts(64)
    assert len(set(texts)) == 64
    assert texts[0].endswith(bench.PASSAGES[0])
    assert bench.with_typos(bench.PASSAGES[1]) != bench.PASSAGES[1]
    assert sorted(bench.rotated(bench.PASSAGES[2], 1).split()) == sorted(bench.PASSAGES[2].split())


@pytest.mark.parametrize("rate, k, accepted", [(0.0, 4, 0), (1.0, 4, 4), (0.5, 4, 2), (0.5, 1, None)])
def test_the_forced_proposer_leads_with_the_forced_share_of_true_tokens(rate, k, accepted):
    truth = list(range(100, 140))
    proposer = bench.ForcedProposer({(1, 2): truth}, k, rate, vocab=1000)
    request = SimpleNamespace(prompt_token_ids=[1, 2], num_prompt_tokens=2,
                              all_token_ids=[1, 2, *truth[:5]])
    drafts = [proposer.propose([request], [8])[0] for _ in range(4)]
    for draft in drafts:
        assert len(draft) == k
        right = next((i for i, (a, b) in enumerate(zip(draft, truth[5:])) if a != b), k)
        assert all(a != b for a, b in zip(draft[right:], truth[5 + right:]))
        if accepted is not None:
            assert right == accepted
    if accepted is None:  # k=1 at 50%: every other draft is right
        assert [d[0] == truth[5] for d in drafts] == [False, True, False, True]
    assert len(proposer.propose([request], [2])[0]) == min(k, 2)  # the engine's limit caps k
    assert proposer.diverged == 0
    request.all_token_ids[-1] += 1  # off the recorded continuation: counted
    proposer.propose([request], [8])
    assert proposer.diverged == 1


@pytest.mark.slow
def test_quick_parts_1_2_print_every_column_for_each_variant(capsys):
    bench.main(["--quick", "--parts", "1", "2", "--variants", "ngram"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("parts 1-2"))
    assert "host ISA" in lines[header]
    assert lines[header + 1].split() == ["copy", "1x", "ratio", "open", "1x", "ratio",
                                         "copy", "x4", "ratio", "open", "x4", "ratio"]
    rows = {line.split()[0]: line for line in lines[header + 2:header + 4]}
    assert set(rows) == {"no", "ngram"}
    assert len(rows["no"].split()) == 2 + 4  # "no spec" and a figure per column
    assert len(rows["ngram"].split()) == 1 + 8 and rows["ngram"].count("x") == 4  # + ratios
    acceptance = lines.index(next(line for line in lines if line.startswith("acceptance:")))
    assert lines[acceptance + 2].split() == ["acc", "len"] * 4
    assert lines[acceptance + 3].split()[0] == "ngram" and len(lines[acceptance + 3].split()) == 9
    assert "targets, ngram: copy 1x" in out
    assert "ngram, first copy answer:" in out
