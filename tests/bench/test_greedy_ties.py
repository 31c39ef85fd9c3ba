"""bench/greedy_ties.py reports, per prompt, where each low-precision run parts from HF at
float32 and float32's top-2 gap there; at float32 itself nothing parts (the engine's
greedy output equals HF's)."""
from bench import greedy_ties
from bench.make_model import make_model


def test_first_difference():
    assert greedy_ties.first_difference([1, 2, 3], [1, 2, 4]) == 2
    assert greedy_ties.first_difference([5], [6, 7]) == 0
    assert greedy_ties.first_difference([1, 2], [1, 2, 3]) == 2


def test_float32_runs_never_part(tmp_path, capsys):
    folder = make_model("tiny", tmp_path / "tiny", seed=0, gguf=())
    greedy_ties.main(["--model", str(folder), "--dtype", "float32", "--prompts", "3",
                      "--tokens", "6"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("prompt")]
    assert lines == [f"prompt {i}: engine float32 6/6; HF float32 6/6" for i in range(3)]
