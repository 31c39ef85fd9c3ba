"""MXFP4 test models: a small quantizer into kernels/torch_mxfp4.py's format, and a gpt-oss
folder (testing/tiny_model.py's) rewritten with its experts as openai/gpt-oss ships them:
`mlp.experts.{gate_up,down}_proj_blocks` / `_scales` and `quant_method: mxfp4`.

The quantizer only has to produce valid MXFP4, not the best one: each block of 32 gets
the smallest power-of-two scale under which its largest magnitude fits E2M1's 6, and
each value rounds to the nearest E2M1 value (a tie to the smaller magnitude)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kernels.torch_mxfp4 import BLOCK, FP4_VALUES, dequantize

_MAGNITUDES = torch.tensor(FP4_VALUES[:8], dtype=torch.float64)
# HF's names for a gpt-oss layer's stacked experts, with the dense tensor's layout
_EXPERTS = ("gate_up_proj", "down_proj")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] (cols a multiple of 32) -> (blocks uint8 [..., cols // 32, 16],
    scales uint8 [..., cols // 32])."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: {w.shape[-1]} columns are not a multiple of {BLOCK}")
    values = w.double().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)
    amax = values.abs().amax(dim=-1)
    # smallest e with amax / 2^e <= 6; an all-zero block takes scale 1
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, 1.0)))
    exponent = exponent.clamp(-127, 127)
    scaled = values / torch.exp2(exponent)[..., None]
    # nearest magnitude: argmin picks the first (smaller) of two equally near
    code = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(dim=-1)
    code = code | torch.where(scaled < 0, 8, 0)
    pairs = code.to(torch.uint8).reshape(*code.shape[:-1], BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def quantize_gpt_oss_dir(dense_dir: str | Path, out_dir: str | Path,
                         dequantized_dir: str | Path | None = None) -> Path:
    """Write `dense_dir` (a bf16 / float32 gpt-oss folder) to `out_dir` as an MXFP4
    checkpoint; biases and every other tensor unchanged. `dequantized_dir`: also write the
    same model with the experts dequantized back to the folder's dtype, the dense model
    an MXFP4 reader must equal."""
    from safetensors.torch import load_file, save_file
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(dense_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    quantized, restored = {}, {}
    for name, tensor in tensors.items():
        part = name.rsplit(".", 1)[-1]
        if ".mlp.experts." not in name or part not in _EXPERTS:
            quantized[name] = restored[name] = tensor
            continue
        # HF's dense experts are [E, in, out]; the blocks run along `in`, one row per output
        # (gate_up's outputs stay interleaved, as in the dense tensor)
        blocks, scales = quantize(tensor.transpose(1, 2))
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        restored[name] = dequantize(blocks, scales, tensor.dtype).transpose(1, 2).contiguous()
    config = json.loads((dense_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    for folder, weights, cfg in ((out_dir, quantized, config),
                                 (dequantized_dir, restored, None)):
        if folder is None:
            continue
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for file in dense_dir.iterdir():
            if file.is_file() and ".safetensors" not in file.name and file.name != "config.json":
                shutil.copyfile(file, folder / file.name)
        if cfg is None:
            shutil.copyfile(dense_dir / "config.json", folder / "config.json")
        else:
            (folder / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
