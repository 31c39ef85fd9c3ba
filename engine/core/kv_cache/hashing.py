"""Chained hashes of full blocks: a block's hash covers its parent's hash, its own
token ids and the request's extra keys (LoRA adapter, cache_salt), so equal hashes mean equal
prefixes, not merely equal blocks.

`builtin` (Python's hash() of the tuple) is the fast default; it is not meant to be
reproduced outside the process. The others are vLLM 0.32's `prefix_caching_hash_algo`
values (vllm/utils/hashing.py) with vLLM's inputs (vllm/v1/core/kv_cache_utils.py,
hash_block_tokens): the tuple (parent, token ids, extra keys), serialized by pickle
(`sha256`, `xxhash`) or canonical CBOR (`sha256_cbor`, `xxhash_cbor`), then hashed with
SHA-256 or XXH3-128. With `sha256_cbor` an indexer in any language that hashes the same
tokens the same way gets the keys this engine publishes in its KV events.

The first block's parent (vLLM's NONE_HASH) is the hash of a seed, vLLM's rule
(init_none_hash / resolve_none_hash_seed): PYTHONHASHSEED when set; otherwise vLLM's
fixed seed string for the SHA-256 algorithms, and 32 random bytes (hex), drawn once per
process, for the xxhash ones, which are not collision resistant: a seed anyone can
predict would let a crafted prompt collide with another tenant's blocks. So xxhash keys
are reproducible outside the process only with PYTHONHASHSEED set alike on both sides,
exactly as with vLLM."""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
from typing import Any, Callable

from engine.config.cache import HASH_ALGOS
from engine.core.request import Request

logger = logging.getLogger(__name__)

# vLLM's seed for the first block's parent when PYTHONHASHSEED is not set.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
# The algorithms whose seed must stay secret (vLLM's _NON_CRYPTO_HASH_FUNCTIONS).
NON_CRYPTO_ALGOS = frozenset({"xxhash", "xxhash_cbor"})

BlockHash = int | bytes

_random_seed: str | None = None


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor(value: Any) -> bytes:
    import cbor2  # only with the CBOR algorithms

    return cbor2.dumps(value, canonical=True)


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(_cbor(value)).digest()


def _xxh3_128():
    try:
        import xxhash
    except ImportError:
        raise ValueError("prefix_caching_hash_algo xxhash / xxhash_cbor needs the xxhash package "
                         "(pip install xxhash)") from None
    if not hasattr(xxhash, "xxh3_128_digest"):
        raise ValueError(f"prefix_caching_hash_algo xxhash / xxhash_cbor needs xxhash >= 2.0 "
                         f"(xxh3_128_digest); this one is {xxhash.VERSION}")
    return xxhash.xxh3_128_digest


def _hash_function(algo: str) -> Callable[[Any], BlockHash]:
    if algo == "builtin":
        return hash
    if algo == "sha256":
        return _sha256
    if algo == "sha256_cbor":
        return _sha256_cbor
    digest = _xxh3_128()
    if algo == "xxhash":
        return lambda value: digest(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return lambda value: digest(_cbor(value))


def none_hash_seed(algo: str) -> str:
    """vLLM's resolve_none_hash_seed."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo in NON_CRYPTO_ALGOS:
        global _random_seed
        if _random_seed is None:
            _random_seed = os.urandom(32).hex()
            logger.warning("prefix_caching_hash_algo=%s: the first block's parent is seeded with "
                           "random bytes, as vLLM does for a hash that is not collision "
                           "resistant, so its block hashes are not reproducible outside this "
                           "process; set PYTHONHASHSEED alike on the engines and the indexer to "
                           "share them, or use sha256_cbor", algo)
        return _random_seed
    return DEFAULT_NONE_HASH_SEED


class BlockHasher:
    def __init__(self, algo: str = "builtin") -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {HASH_ALGOS}, got {algo!r}")
        self.algo = algo
        fn = _hash_function(algo)
        self._fn = fn
        # builtin keeps None as the first parent: nothing outside needs to agree with it.
        self.none_hash: BlockHash | None = None if algo == "builtin" else fn(none_hash_seed(algo))

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
    """What vLLM 0.32 hashes (generate_block_hash_extra_keys): the adapter's ("lora",
    name, path) on every block, then the salt, tagged with its source, on the first
    block only (a salted prompt's later blocks differ through the chain)."""
    keys = () if lora_key is None else (lora_key,)
    if block_index == 0 and cache_salt:
        keys += (("cache_salt", cache_salt),)
    return keys or None


def lora_extra_key(request: Request) -> tuple | None:
    """vLLM's LoRA extra key: the path too, so a name re-pointed at another adapter
    does not reuse KV the old one computed."""
    lora = request.lora_request
    return None if lora is None else ("lora", lora.lora_name, lora.lora_path)


def event_extra_keys(cache_salt: str | None, block_index: int,
                     lora_key: tuple | None = None) -> tuple | None:
    """What vLLM 0.32 publishes for that block in BlockStored.extra_keys
    (to_event_extra_keys): the same keys untagged, so the adapter's name and the bare salt."""
    keys = block_extra_keys(cache_salt, block_index, lora_key)
    return None if keys is None else tuple(key[1] for key in keys)


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
