"""The one place that picks a kernel, and the engine's one door into kernels/: the engine
imports this package and nothing else there (the weight types it builds, GgufWeight and
LinearWeight, and CPU detection come through it too; tests/kernels/test_dispatch.py).

Paged attention takes a layer's sliding window and logit soft cap (keywords, None for
off); every path below implements both or declines to one that does.

Each op goes, by the device of its tensors:
  CUDA -> the Triton kernel where one exists (paged attention, KV writes), else torch;
  CPU  -> the native C kernel when it handles the dtype and layout, else torch.
The torch versions (kernels/torch_ops.py) define every op's semantics. Adding a device or
an ISA-specific kernel means one more branch in the module that owns the op; the callers
do not change. One module a kind of op: attention (paged attention, KV writes),
elementwise (norms, silu_mul / gelu_tanh_mul, rope, argmax), matmul (dense linear layers:
`prepare_linear` lays a loaded weight out once, `linear` picks by its kind and the row count; the fused
single-sequence step), gguf (quantized blocks) and lora (adapter updates).

Batch-invariant mode (the engine's batch_invariant) takes the row count out of every
choice: float32 matmuls run the native GEMM for any number of rows, one included, wherever
it builds (each output is one FMA chain over `in` in order, whatever rows share its tile;
threads split the columns, never the sum), bf16 ones the native row kernel (a fixed 8-wide
order), GGUF weights the int8 kernel's one-row arithmetic (the VNNI panel kernel is
row-invariant as it is), LoRA updates the native kernel's row-by-row sums, and attention
runs every query token as a decode row (keys in block_size blocks in position order), so a
token's values depend on its own row alone. Norms already run per row.
kernels/torch_invariant.py covers what the native kernels decline.

These run ~100 times per decode step, so each does one device test and one call: no
allocation or feature detection of its own (cpu_native caches its library load). The
Triton module is imported only for CUDA tensors, so CPU deployments never need triton.
"""
from kernels.cpu.decode_step import DecodeStepPlan, LayerWeights  # noqa: F401
# What the engine needs to know of the host: the features the kernels are built for
# (TLE_CPU_ISA's cap applied) and the CPUs this process may use.
from kernels.cpu.features import affinity_cpus  # noqa: F401
from kernels.cpu.features import detect as detect_cpu  # noqa: F401
from kernels.dispatch.attention import (BF16_AMX_PREFILL_MIN_WORK,  # noqa: F401
                                        BF16_AMX_TILE_MAX_WORK, paged_attention,
                                        reshape_and_cache, warm_up)
from kernels.dispatch.elementwise import (add_rms_norm, argmax_rows, gelu_tanh_mul,  # noqa: F401
                                         gemma_rms_norm, rope, silu_mul)
from kernels.dispatch.gguf import (GGUF_AMX_MIN_ROWS, GGUF_DENSE_MIN_ROWS,  # noqa: F401
                                   GGUF_PANEL_MIN_ROWS, gguf_embedding, gguf_kernel_available,
                                   gguf_linear, prepare_gguf)
from kernels.dispatch.lora import (LORA_TORCH_MIN_ROWS, lora_add,  # noqa: F401
                                   lora_torch_min_rows, prepare_lora, split_lora_segments)
from kernels.dispatch.matmul import (BF16_TILES_MIN_ROWS, DENSE_ROWS_MAX,  # noqa: F401
                                     bf16_panels_preferred, build_matmul_primitives,
                                     decode_step_plan, dense_linear_rows, gate_up_silu,
                                     invariant_linear, linear, prepare_linear, unpack_linear)
from kernels.dispatch.moe import ExpertWeights, fused_moe  # noqa: F401
# gpt-oss's MXFP4 experts: the 32-value block and the stack that holds them.
from kernels.torch_mxfp4 import BLOCK as MXFP4_BLOCK  # noqa: F401
from kernels.torch_mxfp4 import Mxfp4Stack  # noqa: F401
from kernels.gguf_weight import FORMATS as GGUF_FORMATS  # noqa: F401
from kernels.gguf_weight import GgufWeight  # noqa: F401
from kernels.linear_weight import LinearWeight  # noqa: F401
# The engine builds a step's segments and lays adapters out through these re-exports.
from kernels.lora_ops import LoRASegments, LoRAWeights, SegmentWeights, make_segments  # noqa: F401
