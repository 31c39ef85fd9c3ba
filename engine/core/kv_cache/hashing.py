"""Chained hashes of full blocks: a block's hash covers its parent's hash, its own
token ids and the request's extra keys (LoRA adapter, cache_salt), so equal hashes mean equal
prefixes, not merely equal blocks.

`builtin` (Python's hash() of the tuple) is the fast default; it is not meant to be
reproduced outside the process. `sha256` and `sha256_cbor` are vLLM's
`prefix_caching_hash_algo` values with vLLM's inputs: the tuple (parent, token ids,
extra keys), the first block's parent being the hash of PYTHONHASHSEED (vLLM's fixed
seed string when unset). With `sha256_cbor` an indexer in any language that hashes the
same tokens the same way (canonical CBOR, then SHA-256) gets the keys this engine
publishes in its KV events."""
from __future__ import annotations

import hashlib
import os
import pickle
from typing import Any, Callable

from engine.config.cache import HASH_ALGOS
from engine.core.request import Request

# vLLM's seed for the first block's parent when PYTHONHASHSEED is not set.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

BlockHash = int | bytes


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only with this algorithm

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


class BlockHasher:
    def __init__(self, algo: str = "builtin") -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
        self.algo = algo
        fn: Callable[[Any], BlockHash] = {"builtin": hash, "sha256": _sha256,
                                          "sha256_cbor": _sha256_cbor}[algo]
        self._fn = fn
        # builtin keeps None as the first parent: nothing outside needs to agree with it.
        self.none_hash: BlockHash | None = (
            None if algo == "builtin"
            else fn(os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)))

    def hash_block(self, parent_hash: BlockHash | None, token_ids: tuple[int, ...],
                   extra_keys: tuple | None = None) -> BlockHash:
        parent = self.none_hash if parent_hash is None else parent_hash
        return self._fn((parent, token_ids, extra_keys))

    def chain(self, token_ids: list[int], block_size: int, cache_salt: str | None = None,
              start: int = 0, stop: int | None = None,
              parent_hash: BlockHash | None = None,
              lora_key: tuple | None = None) -> list[BlockHash]:
        """Hashes of full blocks start..stop-1 of `token_ids` (default: every full block),
        chained on from `parent_hash`, the hash of block start - 1."""
        if stop is None:
            stop = len(token_ids) // block_size
        hashes, parent = [], parent_hash
        for i in range(start, stop):
            parent = self.hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]),
                                     block_extra_keys(cache_salt, i, lora_key))
            hashes.append(parent)
        return hashes


def block_extra_keys(cache_salt: str | None, block_index: int,
                     lora_key: tuple | None = None) -> tuple | None:
    """vLLM's form: the adapter's ("lora", name, path) on every block, then the salt,
    tagged, on the first block only (a salted prompt's later blocks differ through the
    chain)."""
    keys = () if lora_key is None else (lora_key,)
    if block_index == 0 and cache_salt:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def lora_extra_key(request: Request) -> tuple | None:
    """vLLM's LoRA extra key: the path too, so a name re-pointed at another adapter
    does not reuse KV the old one computed."""
    lora = request.lora_request
    return None if lora is None else ("lora", lora.lora_name, lora.lora_path)


def update_block_hashes(request: Request, block_size: int, hasher: BlockHasher) -> list[BlockHash]:
    """Extend request.block_hashes to cover every full block of its tokens."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if len(hashes) < num_full:
        hashes.extend(hasher.chain(request.all_token_ids, block_size, request.cache_salt,
                                   start=len(hashes), stop=num_full,
                                   parent_hash=hashes[-1] if hashes else None,
                                   lora_key=lora_extra_key(request)))
    return hashes
