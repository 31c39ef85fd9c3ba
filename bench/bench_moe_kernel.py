"""The native fused-MoE kernel (kernels/cpu/moe.c) against its torch definition
(kernels/torch_moe.fused_moe: per-expert matmuls) at one layer of Qwen3-30B-A3B
(128 experts, top-8, hidden 2048, expert intermediate 768, bf16: ~1.2 GB of experts).

    PYTHONPATH=. python -m bench.bench_moe_kernel [--tokens 1 64] [--threads 2]
        [--seconds 3] [--layers 1]

A single stream (1 token) reads only its 8 experts' weights (75 MB), so its figure of
merit is the bandwidth those reads reach against a plain read of memory measured in the
same run: torch's sum over a 1 GB tensor (best of a few, printed first), and per call a
float32 sum over 75 MB of it (the "read GB/s" column, median, taken between the calls so
both meet the same load on a shared host). For a batch, "read GB/s" is the 1 GB figure. The single token's experts walk
through all 128 in turn, 8 new ones a call, the torch side half a cycle behind, so each
call reads them from memory: no cache (this host's L3 may hold 480 MB) still holds them. A batch draws each
token's experts at random, as a router's top-8 does (nearly every expert active at 64).
The sides alternate call by call; each figure is the median call.

Then (unless --no-mxfp4) one layer shape of gpt-oss-20b with its experts in MXFP4
(kernels/cpu/moe_mxfp4.c: 32 experts, top-4, hidden and intermediate 2880, biases,
swigluoai; 422 MB of blocks and scales a layer) at one token, bf16 and float32
activations: the GB/s of MXFP4 bytes (blocks and scales) its 4 experts read per call,
against a float32 sum over as many bytes of the 1 GB tensor between the calls, as above.
The token walks the 32 experts 4 at a time through --mxfp4-layers layers (default 2,
844 MB: more than the L3 this host may report), so each call reads from memory.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels.cpu import features as cpu_features

cpu_features.detect()  # before the first tensor op (the caps reach oneDNN at its first use)

from kernels.cpu.moe import fused_moe_cpu  # noqa: E402
from kernels.torch_moe import fused_moe  # noqa: E402
from kernels.torch_mxfp4 import BLOCK, Mxfp4Stack  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
OFFSET = EXPERTS // TOP_K // 2
GIGABYTE = 10 ** 9


def read_bandwidth(flat: torch.Tensor, repeats: int = 4) -> float:
    """GB/s of torch's sum over a tensor too large for any cache, best of `repeats`, summed
    as bf16 and as its bytes viewed as float32: torch's bf16 sum ran 6 GB/s where the
    float32 one ran 9 (2-core Sapphire Rapids), so the bf16 one alone understates memory."""
    best = float("inf")
    for view in (flat, flat.view(torch.float32)):
        for _ in range(repeats):
            start = time.perf_counter()
            view.sum()
            best = min(best, time.perf_counter() - start)
    return flat.numel() * 2 / best / 1e9


def routes(tokens: int, calls: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each call's (topk_weights, topk_ids): one token walks the experts 8 at a time; a
    batch's tokens take the top-8 of random router logits."""
    out = []
    for call in range(calls):
        if tokens == 1:
            ids = (torch.arange(TOP_K) + call * TOP_K) % EXPERTS
            weights = torch.rand(TOP_K, generator=g).softmax(-1)
            out.append((weights[None], ids[None]))
        else:
            logits = torch.randn(tokens, EXPERTS, generator=g)
            weights, ids = torch.topk(logits.softmax(-1), TOP_K)
            out.append((weights / weights.sum(-1, keepdim=True), ids))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: keep default)")
    parser.add_argument("--seconds", type=float, default=3.0, help="per side and token count")
    parser.add_argument("--layers", type=int, default=1,
                        help="independent expert sets, cycled call by call (more: colder)")
    parser.add_argument("--no-mxfp4", action="store_true", help="skip the gpt-oss MXFP4 line")
    parser.add_argument("--mxfp4-layers", type=int, default=2,
                        help="MXFP4 layers cycled call by call (422 MB each)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    layers = [((torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.02).bfloat16(),
               (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.02).bfloat16())
              for _ in range(args.layers)]
    flat = torch.ones(GIGABYTE // 2, dtype=torch.bfloat16)
    bandwidth = read_bandwidth(flat)
    expert_bytes = 3 * HIDDEN * INTER * 2
    print(f"{cpu_features.detect().describe()}, torch threads {torch.get_num_threads()}; "
          f"plain read (torch sum over 1 GB): {bandwidth:.1f} GB/s")
    print(f"{'tokens':>6} {'native tok/s':>13} {'torch tok/s':>12} {'ratio':>6} "
          f"{'native GB/s':>12} {'read GB/s':>10} {'native/read':>11}")
    for tokens in args.tokens:
        x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
        plan = routes(tokens, 64, g)
        sides = {"native": fused_moe_cpu, "torch": fused_moe}
        # A plain read of as many bytes as one token's experts, between the calls (a
        # shared host's load moves from second to second): float32 sums over successive
        # slices of the 1 GB tensor, cold as the experts are.
        active = TOP_K * expert_bytes // 4
        slices = [flat.view(torch.float32)[i:i + active]
                  for i in range(0, flat.numel() // 2 - active + 1, active)]
        reads: list[float] = []
        times: dict[str, list[float]] = {name: [] for name in sides}
        active_bytes: list[int] = []
        start_all, call = time.perf_counter(), 0
        while time.perf_counter() - start_all < 2 * args.seconds or call < 4:
            w13, w2 = layers[call % len(layers)]
            for name, fn in sides.items():
                # torch's side half the expert cycle apart: each side reads experts the
                # other has not just pulled into cache
                weights, ids = plan[(call + (OFFSET if name == "torch" else 0)) % len(plan)]
                start = time.perf_counter()
                out = fn(x, w13, w2, weights, ids)
                times[name].append(time.perf_counter() - start)
                assert out is not None, name
            active_bytes.append(int(torch.unique(ids).numel()) * expert_bytes)
            if tokens == 1:
                start = time.perf_counter()
                slices[call % len(slices)].sum()
                reads.append(time.perf_counter() - start)
            call += 1
        # the first calls warm allocators and the thread pool
        native = statistics.median(times["native"][2:])
        torch_side = statistics.median(times["torch"][2:])
        gbps = statistics.median(active_bytes) / native / 1e9
        read = active * 4 / statistics.median(reads[2:]) / 1e9 if reads else bandwidth
        print(f"{tokens:>6} {tokens / native:>13.1f} {tokens / torch_side:>12.1f} "
              f"{torch_side / native:>5.2f}x {gbps:>12.1f} {read:>10.1f} {gbps / read:>10.0%}")
    if not args.no_mxfp4:
        bench_mxfp4(flat, g, args.seconds, args.mxfp4_layers)


def bench_mxfp4(flat: torch.Tensor, g: torch.Generator, seconds: float, num_layers: int) -> None:
    """One token through a gpt-oss-20b MXFP4 layer: GB/s of blocks and scales read against
    a plain read of as many bytes, measured between the calls (see the module docstring)."""
    experts, top_k, hidden, inter = 32, 4, 2880, 2880

    def stack(rows: int, cols: int) -> Mxfp4Stack:
        # random codes at scales 2^-9..2^-5: values of a trained layer's size
        blocks = torch.randint(0, 256, (experts, rows, cols // BLOCK, BLOCK // 2),
                               dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 123, (experts, rows, cols // BLOCK), dtype=torch.uint8,
                               generator=g)
        return Mxfp4Stack(blocks, scales, torch.bfloat16)

    layers = [(stack(2 * inter, hidden), stack(hidden, inter)) for _ in range(num_layers)]
    expert_bytes = (layers[0][0].nbytes + layers[0][1].nbytes) // experts
    active = top_k * expert_bytes // 4  # float32 elements of the plain read
    slices = [flat.view(torch.float32)[i:i + active]
              for i in range(0, flat.numel() // 2 - active + 1, active)]
    print(f"gpt-oss-20b MXFP4 layer (E={experts}, k={top_k}, H=I={hidden}, "
          f"{expert_bytes / 1e6:.1f} MB an expert), 1 token:")
    print(f"{'x dtype':>9} {'ms/call':>8} {'MXFP4 GB/s':>11} {'read GB/s':>10} {'mxfp4/read':>11}")
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, hidden, generator=g).to(dtype)
        b13 = torch.randn(experts, 2 * inter, generator=g).to(dtype) * 0.1
        b2 = torch.randn(experts, hidden, generator=g).to(dtype) * 0.1
        cycle = experts // top_k
        times: list[float] = []
        reads: list[float] = []
        start_all, call = time.perf_counter(), 0
        while time.perf_counter() - start_all < seconds or call < 4:
            w13, w2 = layers[(call // cycle) % num_layers]
            w13, w2 = Mxfp4Stack(w13.blocks, w13.scales, dtype), Mxfp4Stack(w2.blocks, w2.scales,
                                                                            dtype)
            ids = ((torch.arange(top_k) + call * top_k) % experts)[None]
            weights = torch.rand(1, top_k, generator=g).softmax(-1)
            start = time.perf_counter()
            out = fused_moe_cpu(x, w13, w2, weights, ids, "swigluoai", w13_bias=b13, w2_bias=b2)
            times.append(time.perf_counter() - start)
            assert out is not None
            start = time.perf_counter()
            slices[call % len(slices)].sum()
            reads.append(time.perf_counter() - start)
            call += 1
        native = statistics.median(times[2:])
        gbps = top_k * expert_bytes / native / 1e9
        read = active * 4 / statistics.median(reads[2:]) / 1e9
        print(f"{str(dtype).removeprefix('torch.'):>9} {native * 1e3:>8.2f} {gbps:>11.1f} "
              f"{read:>10.1f} {gbps / read:>10.0%}")


if __name__ == "__main__":
    main()
