"""--reasoning-parser against vLLM 0.32's own parsers (deepseek_r1, qwen3): the same model
texts, streamed to vLLM token by token with the prompt's ids as its chat server streams
them, split into the same reasoning and content by ours, for either parser, with and
without enable_thinking, after prompts that leave reasoning open, unopened or closed."""
from __future__ import annotations

from openai_frontend.chat import default_tokenizer_path
from openai_frontend.reasoning import ReasoningParser

# vLLM's parsers find their tags as tokens; SmolLM2's tokenizer gets them (not special,
# as in Qwen3's and DeepSeek-R1's tokenizers).
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TEXTS = ["<think>abc</think>hello", "abc</think>hello", "no tags at all", "<think>abc",
         "hi <think>x</think>y", "<think>a</think>b</think>c", "<think>a<think>b</think>c<think>d",
         "<think>\n\n</think>\n\nhello", "<think>r</think>", "</think>",
         '<think>r<tool_call>{"x": 1}</tool_call>', "pre<think>r</think>post",
         "Let me think. 2 < 3, so</think>\n\nThe answer is 3."]
PROMPTS = ["<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n",
           "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"]

_STREAM = """
import json, sys
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager
p = json.load(sys.stdin)
tok = AutoTokenizer.from_pretrained(p["tokenizer"])
tok.add_tokens(p["added"], special_tokens=False)
out = []
for case in p["cases"]:
    kwargs = case["kwargs"]
    cls = ParserManager.get_parser(reasoning_parser_name=case["parser"], tokenizer=tok)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                chat_template_kwargs=kwargs or None)
    parser = cls(tok, None, chat_template_kwargs=kwargs)
    reasoning, content = [], []
    for i, (text, ids) in enumerate(case["deltas"]):
        delta = parser.parse_delta(text, ids, req, case["prompt_ids"],
                                   finished=i == len(case["deltas"]) - 1)
        if delta is not None:
            reasoning.append(delta.reasoning or ""); content.append(delta.content or "")
    out.append(["".join(reasoning), "".join(content)])
print(json.dumps(out))
"""


def test_splits_agree_with_vllms_streamed_parsers(vllm_side):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    tok.add_tokens(ADDED)
    cases = []
    for parser in ("deepseek_r1", "qwen3"):
        for kwargs in ({}, {"enable_thinking": False}):
            for prompt in PROMPTS:
                for text in TEXTS:
                    ids = tok.encode(text, add_special_tokens=False)
                    deltas, before = [], ""
                    for i in range(len(ids)):  # as the engine detokenizes: token by token
                        now = tok.decode(ids[:i + 1])
                        deltas.append([now[len(before):], [ids[i]]])
                        before = now
                    assert before == text
                    cases.append({"parser": parser, "kwargs": kwargs, "text": text,
                                  "prompt": prompt, "deltas": deltas,
                                  "prompt_ids": tok.encode(prompt, add_special_tokens=False)})
    theirs = vllm_side.run(_STREAM, {"tokenizer": str(default_tokenizer_path()), "added": ADDED,
                                     "cases": cases})
    assert len(theirs) == len(cases)
    for case, (reasoning, content) in zip(cases, theirs):
        plan = ReasoningParser(case["parser"]).plan(case["prompt"], case["kwargs"])
        ours = plan.split(case["text"])
        assert [ours[0] or "", ours[1] or ""] == [reasoning, content], case
        # Our stream, fed vLLM's deltas, releases the same.
        stream = plan.stream()
        pieces = [stream.feed(text) for text, _ in case["deltas"]] + [stream.finish()]
        assert ["".join(r for r, _ in pieces), "".join(c for _, c in pieces)] == \
            [reasoning, content], case
