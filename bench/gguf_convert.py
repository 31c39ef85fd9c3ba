"""Rewrite a GGUF file with its quantized tensors dequantized to F32, BF16 or F16, so
llama.cpp can run the same weights at the precision this engine runs them.

Needs only the `gguf` package and numpy (it never imports this project), so it runs in
llama.cpp's peer venv (see bench/llamacpp_peer.py):

  VENV/bin/python bench/gguf_convert.py MODEL.gguf --type F32    # prints the cached path

Every metadata key/value pair is copied with its original value type (arrays, strings and
the tokenizer tables included); general.file_type is set to the target. Tensors keep their
names and order. Tensors already stored as F32 are kept as they are, and so are F16/BF16
ones unless the target is F32 (they widen exactly: an engine running a BF16 checkpoint in
float32 computes on those values); for BF16 and F16 targets 1-D tensors (the norms) become
F32, as llama.cpp's own converter does. Tensors are spooled to a temporary file as they are
converted, so a 1B model's F32 copy (5 GB) never sits in memory.
Results are cached under <cache>/peers/, keyed by source path, size, mtime and target.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

TARGETS = {  # target name -> (tensor type, general.file_type)
    "F32": (QT.F32, LlamaFileType.ALL_F32),
    "BF16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
    "F16": (QT.F16, LlamaFileType.MOSTLY_F16),
}
HALF = {QT.F16, QT.BF16}  # unquantized: copied untouched, except widened for an F32 target
_VERSION = 2  # bump when the output changes, so stale cached files are not reused


def cache_dir() -> Path:
    # Same root as engine.models.gguf_cache.cache_root() (not imported: other venv).
    explicit = os.environ.get("TLE_CACHE_DIR")
    if explicit:
        return Path(explicit) / "peers"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "triton-llm-engine" / "peers"


def _copy_field(writer: GGUFWriter, field) -> None:
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise ValueError(f"{field.name}: nested arrays are not supported")
        if not field.data:  # the writer refuses empty arrays; nothing to carry over
            return
        # contents() gives str for STRING items and Python numbers/bools otherwise;
        # sub_type keeps the item width (an INT32 array stays INT32).
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    else:
        writer.add_key_value(field.name, field.contents(), kind)


def convert(src: str | os.PathLike, dst: str | os.PathLike, target: str = "F32") -> None:
    qtype, file_type = TARGETS[target]
    reader = GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    writer = GGUFWriter(dst, arch, use_temp_file=True)  # adds general.architecture itself
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # header pseudo-fields, and the one the writer already holds
        if name == "general.alignment":
            writer.data_alignment = field.contents()
        if name == "general.file_type":
            writer.add_key_value(name, int(file_type), GGUFValueType.UINT32)
        else:
            _copy_field(writer, field)
    for t in reader.tensors:
        if t.tensor_type == QT.F32 or (t.tensor_type in HALF and target != "F32"):
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        values = dequantize(t.data, t.tensor_type)  # float32, numpy (row-major) shape
        out = QT.F32 if target == "F32" or values.ndim == 1 else qtype
        if out == QT.F32:
            writer.add_tensor(t.name, values.astype(np.float32, copy=False))
        elif out == QT.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:  # BF16 travels as raw bytes with its type given explicitly
            writer.add_tensor(t.name, quantize(values, QT.BF16), raw_dtype=QT.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def cached_conversion(src: str | os.PathLike, target: str = "F32") -> Path:
    """Path of `src` converted to `target`, converting on first use."""
    src = Path(src).resolve()
    st = src.stat()
    ident = f"{src}|{st.st_size}|{st.st_mtime_ns}|{target}|v{_VERSION}"
    dst = cache_dir() / f"{src.stem}-{target}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.gguf"
    if dst.is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Write beside the target and rename, so a concurrent or interrupted run never
    # leaves a half-written file under the final name.
    fd, tmp = tempfile.mkstemp(prefix=".convert-", suffix=".gguf", dir=dst.parent)
    os.close(fd)
    try:
        convert(src, tmp, target)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("--type", choices=sorted(TARGETS), default="F32")
    ap.add_argument("--out", help="write here instead of the cache (always converts)")
    args = ap.parse_args()
    if args.out:
        convert(args.src, args.out, args.type)
        print(args.out)
    else:
        print(cached_conversion(args.src, args.type))


if __name__ == "__main__":
    main()
