"""What every proposer does, and which one a SpeculativeConfig gets."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from engine.config.speculative import SpeculativeConfig
    from engine.core.request import Request


class Proposer(Protocol):
    def propose(self, requests: Sequence["Request"], limits: Sequence[int]) -> list[list[int]]:
        """Per request, at most limits[i] (>= 1) guessed next tokens, [] for none. Called
        between steps for running requests whose last step sampled; reads their tokens
        (all_token_ids: prompt and accepted output), never changes them."""

    def finished(self, requests: Sequence["Request"]) -> None:
        """These requests ended (stopped, capped or aborted): drop their state."""


def make_proposer(config: "SpeculativeConfig", **context) -> Proposer:
    """`context`: what a method needs from the engine (draft_model: the target's loaded
    model, its KV pool and dtype)."""
    if config.method == "ngram":
        from engine.spec_decode.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from engine.spec_decode.suffix import SuffixProposer
        return SuffixProposer(config)
    if config.method == "draft_model":
        from engine.spec_decode.draft_model import DraftModelProposer
        return DraftModelProposer(context["draft"], context["num_kv_blocks"],
                                  context["block_size"], context["block_table"],
                                  config.draft_sample_method, context.get("seed", 0))
    raise ValueError(f"speculative_config.method {config.method!r} is not available")
