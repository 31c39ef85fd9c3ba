"""A small tokenizer that adds a BOS as Llama-3's and Mistral's do (a TemplateProcessing
post-processor putting `<s>` first), with a chat template that writes the BOS itself, as
theirs do: what shows whether a rendered chat prompt gets a second one. Built with the
tokenizers library and saved as a transformers tokenizer folder."""
from __future__ import annotations

from pathlib import Path

WORDS = ["hello", "there", "how", "are", "you", "user", "assistant", "system", "be", "brief",
         ":", "|"]
SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' bos/eos ids
# Starts with the BOS, as Llama-3's `{{- bos_token }}` and Mistral's `{{ bos_token }}`.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} | "
                 "{% endfor %}{% if add_generation_prompt %}assistant : {% endif %}")


def make_bos_tokenizer_dir(path: str | Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    path = Path(path)
    fast.save_pretrained(path)
    return path
