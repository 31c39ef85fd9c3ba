"""SpeculativeConfig: vLLM's speculative_config, the methods this engine runs.

Given as vLLM takes it: a mapping (LLM(speculative_config={...}), a vllm_backend
model.json) or its JSON text (a config.pbtxt parameter, a CLI flag). Unknown keys,
methods and bad values are refused here, at load, naming the key. engine/spec_decode/
runs what this describes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from engine.config.json_section import section_from_value

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 64
# vLLM's spelling of the n-gram method in older configs.
_ALIASES = {"[ngram]": "ngram"}


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's field names and defaults, except where a comment says otherwise."""
    method: str | None = None
    # How many tokens a step may propose per request (suffix: the most it may).
    num_speculative_tokens: int | None = None
    # method "ngram": the suffix n-gram lengths looked up in the request's own tokens
    # (vLLM's defaults: both 5 when neither is given, the given one when only one is).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # method "draft_model": the draft's folder or .gguf (same tokenizer as the target),
    # its quantization (None or "gguf") and context (None: the target's).
    model: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    # Only 1, or the target's size, is accepted: the draft runs in rank 0's process.
    draft_tensor_parallel_size: int | None = None
    # vLLM 0.32's: "greedy" drafts the draft model's argmax (one-hot drafts);
    # "probabilistic" samples the draft's distribution at the request's temperature and
    # verifies with its probabilities (more drafts kept where the request samples).
    draft_sample_method: str = "greedy"
    # vLLM < 0.10's: a step with more than this many running requests proposes nothing
    # (verification costs compute a big batch does not have). None: always propose.
    disable_by_batch_size: int | None = None
    # method "suffix" (vLLM's suffix decoding).
    suffix_decoding_max_tree_depth: int = 24
    # Finished requests kept per scope (tenant, LoRA adapter) for proposals to later
    # requests of the same scope. 0 here by default, not vLLM's 10000: another request's
    # text is proposed only where the operator turned it on.
    suffix_decoding_max_cached_requests: int = 0
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    def __post_init__(self) -> None:
        method = _ALIASES.get(self.method, self.method)
        if method is None:
            if self.model is None:
                raise ValueError("speculative_config.method is required (one of "
                                 f"{list(METHODS)}), or a draft `model`")
            method = "draft_model"  # vLLM's rule: a model without a method is a draft
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(METHODS)}, "
                             f"got {self.method!r}")
        self.method = method
        k = self.num_speculative_tokens
        if k is None and method == "suffix":
            self.num_speculative_tokens = k = self.suffix_decoding_max_tree_depth
        if k is None:
            raise ValueError(f"speculative_config.num_speculative_tokens is required for "
                             f"method {method!r}")
        _positive("num_speculative_tokens", k)
        if k > MAX_SPECULATIVE_TOKENS:
            # Each position is a metric series and up to that many scored rows per request
            # and step; past a few dozen a draft is never kept whole anyway.
            raise ValueError(f"speculative_config.num_speculative_tokens must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k}")
        if method == "ngram":
            self._ngram_lengths()
        elif self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ValueError("speculative_config.prompt_lookup_min/max: only for method "
                             f"'ngram', got method {method!r}")
        if method == "draft_model":
            if not self.model:
                raise ValueError("speculative_config.model is required for method "
                                 "'draft_model' (the draft's folder or .gguf file)")
        elif self.model is not None:
            raise ValueError(f"speculative_config.model: only for method 'draft_model', "
                             f"got method {method!r}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            raise ValueError("speculative_config.draft_sample_method must be 'greedy' or "
                             f"'probabilistic', got {self.draft_sample_method!r}")
        if self.draft_sample_method != "greedy" and method != "draft_model":
            raise ValueError("speculative_config.draft_sample_method: only for method "
                             f"'draft_model', got method {method!r}")
        if self.quantization not in (None, "gguf"):
            raise ValueError("speculative_config.quantization must be null or 'gguf', got "
                             f"{self.quantization!r}")
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if self.draft_tensor_parallel_size is not None:
            _positive("draft_tensor_parallel_size", self.draft_tensor_parallel_size)
        if self.disable_by_batch_size is not None:
            _positive("disable_by_batch_size", self.disable_by_batch_size)
        self._suffix_values()

    def _ngram_lengths(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        _positive("prompt_lookup_min", low)
        _positive("prompt_lookup_max", high)
        if low > high:
            raise ValueError(f"speculative_config.prompt_lookup_min={low} must be <= "
                             f"prompt_lookup_max={high}")
        self.prompt_lookup_min, self.prompt_lookup_max = low, high

    def _suffix_values(self) -> None:
        _positive("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth)
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("speculative_config.suffix_decoding_max_cached_requests must be "
                             f">= 0, got {self.suffix_decoding_max_cached_requests}")
        if not self.suffix_decoding_max_spec_factor >= 0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be "
                             f">= 0, got {self.suffix_decoding_max_spec_factor}")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {self.suffix_decoding_min_token_prob}")

    def check_target(self, tensor_parallel_size: int) -> None:
        """What depends on the rest of the engine's configuration."""
        tp = self.draft_tensor_parallel_size
        if tp is not None and tp not in (1, tensor_parallel_size):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={tp}: the draft "
                             "runs in one process; use 1")

    @classmethod
    def from_value(cls, name: str, value: Any) -> "SpeculativeConfig | None":
        """A mapping or its JSON text; None, {} or a null word: no speculation."""
        if isinstance(value, Mapping) and not value:
            return None
        return section_from_value(cls, name, value)


def _positive(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
