"""Sliding windows end to end on CPU, a tiny Mistral with a window of 8: the blocks a
long request holds stay bounded by the window while it generates, and prefix-cache hits,
preemption and chunked prefill (windows freeing blocks all the while) give the tokens of
a plain run; so does a two-group layout (per-layer metadata, shared slot tensors, the
CUDA-graph buffers run eagerly). disable_sliding_window turns the window off end to end."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine import startup
from engine.core.kv_cache import build_layout
from engine.core.kv_cache.groups import group_peak_blocks
from engine.models import AttentionMetadata
from testing.tiny_model import make_tiny_model_dir

W = 8
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SYSTEM = list(range(100, 141))  # 41 tokens: five windows and then some
PROMPTS = [SYSTEM + [7 * i + 3, 7 * i + 4, 7 * i + 5] for i in range(5)] + [
    list(range(300, 300 + n)) for n in (3, 9, 17, 30)]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return str(make_tiny_model_dir(tmp_path_factory.mktemp("mistral_sw"), arch="mistral",
                                   seed=4, sliding_window=W))


def generate_ids(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain(mistral):
    """The reference: a pool big enough that nothing is preempted, no prefix cache."""
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=256, max_model_len=128,
              enable_prefix_caching=False)
    return generate_ids(llm, PROMPTS)


def test_blocks_in_use_stay_bounded_by_the_window(mistral, plain):
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128)
    engine = llm.llm_engine
    kv = engine.scheduler.kv_cache_manager
    assert kv.layout.windows == (W,) and kv.num_groups == 1
    prompt = PROMPTS[6]  # 9 tokens, then 6 windows more
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=6 * W,
                                                      ignore_eos=True))
    in_use, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        in_use.append(kv.block_pool.num_blocks - kv.num_free_blocks)
    assert len(tokens) == 6 * W and tokens[:GREEDY.max_tokens] == plain[6]
    # The prefill holds its 9 tokens' 3 blocks; each decode after it the blocks of its
    # window, 3 at most. Kept, the 57 tokens would take 15 blocks.
    assert in_use[0] == 3 and max(in_use[1:-1]) <= group_peak_blocks(W, 10**6, 4, 1) == 3
    assert in_use[-1] == 0


def test_prefix_hits_give_the_tokens_of_no_caching(mistral, plain):
    # A pool small enough that blocks the windows freed are reused, so later prompts
    # resume from a prefix whose head is gone (the window needs only its end).
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=40, max_model_len=128)
    assert generate_ids(llm, PROMPTS) == plain
    assert generate_ids(llm, PROMPTS) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits >= 4 * 40 and stats.kv_cache_usage == 0.0


def test_preemption_and_chunked_prefill_give_the_tokens_of_a_plain_run(mistral, plain):
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=128,
              max_num_batched_tokens=24, long_prefill_token_threshold=7, max_num_seqs=8)
    assert generate_ids(llm, PROMPTS) == plain
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0.0


def test_greedy_matches_hf_with_the_window(mistral, plain):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    for ids, ours in zip(PROMPTS[4:8], plain[4:8]):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens,
                                 do_sample=False, pad_token_id=0)
        assert out[0, len(ids):].tolist() == ours


def test_a_two_group_layout_gives_the_same_tokens(mistral, plain, monkeypatch):
    """Layer 0 in a windowed group, layer 1 in a full one (which keeps more than its
    window reads, harmlessly): the runner's two-group path, per-layer metadata, one slot
    tensor shared by both layers, and the decode-graph buffers per group (run eagerly)."""
    monkeypatch.setattr(startup, "kv_layout", lambda loaded: build_layout([W, None]))
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128,
              max_num_batched_tokens=24, long_prefill_token_threshold=7)
    runner = llm.llm_engine.runner
    assert runner.num_groups == 2 and runner.layout.group_size == 1
    assert runner.kv_caches[0] is runner.kv_caches[1]
    runner.use_decode_graphs(8, 128, capture=False)
    seen = []
    forward = runner.model.forward

    def spy(input_ids, positions, kv_caches, meta):
        seen.append(meta)
        return forward(input_ids, positions, kv_caches, meta)

    monkeypatch.setattr(runner.model, "forward", spy)
    assert generate_ids(llm, PROMPTS) == plain
    assert seen and all(isinstance(m, list) and len(m) == 2 for m in seen)
    windowed, full = seen[-1]  # a decode step, through the graph buffers
    assert windowed.max_seq_len == 128  # the graphs plan for max_model_len
    assert windowed.seq_lens.data_ptr() == full.seq_lens.data_ptr()  # shared
    assert windowed.block_tables.data_ptr() != full.block_tables.data_ptr()
    assert int(windowed.block_tables[0, 0]) == 0  # NULL_BLOCK's id behind the window
    assert llm.llm_engine.get_stats().kv_cache_usage == 0.0


def test_disable_sliding_window_is_one_full_group_capped_at_the_window(mistral):
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=16,
              disable_sliding_window=True)
    engine = llm.llm_engine
    assert engine.scheduler.kv_cache_manager.layout.windows == (None,)
    assert engine.runner.num_groups == 1 and engine.config.scheduler.max_model_len == W
    short = [[10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    windowed = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64)
    # Within the window full attention and the window agree.
    assert generate_ids(llm, short, params) == generate_ids(windowed, short, params)
    with pytest.raises(ValueError, match=r"exceeds the model's context \(8 tokens: its sliding "
                                         r"window, as disable_sliding_window caps it"):
        LLM(mistral, dtype="float32", num_kv_blocks=16, disable_sliding_window=True,
            max_model_len=W + 1)
    with pytest.raises(ValueError, match=r"exceeds the model's context \(max_position_"
                                         r"embeddings 2048\)"):
        LLM(mistral, dtype="float32", num_kv_blocks=1024, max_model_len=4096)


def test_the_pool_must_hold_a_window_not_the_whole_context(mistral):
    # max_model_len 2048 in 4-token blocks is 512 blocks of full attention; with the
    # window and 16-token steps a request holds at most (8 + 16 - 2) // 4 + 2 = 7.
    llm = LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=7,
              max_num_batched_tokens=16)
    assert llm.llm_engine.config.scheduler.max_model_len == 2048
    with pytest.raises(ValueError, match=r"cannot hold one request of max_model_len=2048 "
                                         r"\(7 blocks\)"):
        LLM(mistral, dtype="float32", block_size=4, num_kv_blocks=6, max_num_batched_tokens=16)


def test_a_step_of_several_groups_travels_to_tensor_parallel_workers_whole():
    """What rank 0 sends its workers (engine/distributed/): one metadata per group, moved
    and pickled together, their shared tensors still shared."""
    import pickle

    from engine.worker.model_runner import StepInputs

    qsl, seq_lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    metas = tuple(AttentionMetadata(torch.tensor([slot]), torch.tensor([table], dtype=torch.int32),
                                    qsl, seq_lens, 1, 20)
                  for slot, table in ((21, [0, 0, 5, 6, 7]), (45, [9, 3, 2, 4, 11])))
    inputs = StepInputs(torch.tensor([3]), torch.tensor([19]), metas, torch.tensor([0]))
    moved = pickle.loads(pickle.dumps(inputs.to(torch.device("cpu"))))
    assert isinstance(moved.meta, tuple) and len(moved.meta) == 2
    for got, sent in zip(moved.meta, metas):
        assert torch.equal(got.block_tables, sent.block_tables)
        assert int(got.slot_mapping) == int(sent.slot_mapping)
    assert moved.meta[0].seq_lens.data_ptr() == moved.meta[1].seq_lens.data_ptr()
