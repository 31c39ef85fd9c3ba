"""Chained hashes of full blocks: a block's hash covers its parent's hash, its own
token ids and the request's extra keys (cache_salt), so equal hashes mean equal
prefixes, not merely equal blocks."""
from __future__ import annotations

from engine.request import Request


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: object = None) -> int:
    return hash((parent_hash, token_ids, extra_keys))


def update_block_hashes(request: Request, block_size: int) -> list[int]:
    """Extend request.block_hashes to cover every full block of its tokens."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            parent = hash_block(parent, tuple(tokens[i * block_size:(i + 1) * block_size]),
                                request.cache_salt if i == 0 else None)
            hashes.append(parent)
    return hashes
