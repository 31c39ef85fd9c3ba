"""A tensor-parallel worker process (ranks 1..N-1): load the model, keep this rank's
shard, then run each forward rank 0 broadcasts until it sends None. It keeps no
per-request state (rank 0 samples), so finished requests need not reach it."""
from __future__ import annotations

import ctypes
import signal
from dataclasses import dataclass

import torch

from engine.config.lora import LoRAConfig
from engine.distributed.group import GroupAddress, ParallelGroup


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    address: GroupAddress
    rank: int
    model_dir: str
    dtype: str
    tokenizer: str | None
    num_threads: int
    compute_timeout_s: float
    lora: LoRAConfig | None = None  # enable_lora: this rank loads and shards the adapters
    # the engine's batch_invariant: this rank's kernels and the all-reduce's order
    batch_invariant: bool = False
    model_impl: str = "auto"
    disable_sliding_window: bool = False
    expert_parallel: bool = False  # MoE blocks keep whole experts (sharding.expert_range)


@dataclass(frozen=True, slots=True)
class CacheSetup:
    """Rank 0's resolved KV pool (every rank's pool has the same blocks, laid out in the
    same KV-cache groups) and warm-up limits."""
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int
    # Per layer, the window its KV-cache group has (None: full); empty: the model's own.
    layer_windows: tuple[int | None, ...] = ()


def run_worker(spec: WorkerSpec) -> None:
    """Entry point of a spawned worker; returns (and the process exits) on rank 0's
    None, and raises (a non-zero exit) when rank 0 or another rank goes away."""
    _exit_with_parent()
    if spec.address.device == "cpu":
        torch.set_num_threads(spec.num_threads)
    group = ParallelGroup(spec.address, spec.rank, spec.compute_timeout_s,
                          fixed_sum_order=spec.batch_invariant)
    try:
        _serve(spec, group)
    finally:
        group.close()


def _serve(spec: WorkerSpec, group: ParallelGroup) -> None:
    from engine.core.kv_cache.groups import build_layout
    from engine.worker.model_runner import ModelRunner
    from engine.models import load_model
    from engine.distributed.sharding import shard_loaded
    from kernels import dispatch

    loaded = load_model(spec.model_dir, spec.dtype, tokenizer=spec.tokenizer,
                        device=str(group.device), model_impl=spec.model_impl,
                        disable_sliding_window=spec.disable_sliding_window)
    loaded = shard_loaded(loaded, group, spec.batch_invariant, spec.expert_parallel)
    setup = group.receive_step()
    if setup is None:  # rank 0 gave up before serving (e.g. its KV pool was refused)
        return
    assert isinstance(setup, CacheSetup)
    layout = build_layout(setup.layer_windows) if setup.layer_windows else None
    runner = ModelRunner(loaded, setup.num_kv_blocks, setup.block_size,
                         lora=lora_runtime(loaded, spec.lora, group), layout=layout)
    dispatch.warm_up(runner.kv_caches[0][0], loaded.num_heads, setup.max_model_len,
                     setup.max_num_batched_tokens)
    runner.build_matmul_primitives(setup.max_num_batched_tokens, setup.max_num_seqs)
    group.barrier()  # ready: rank 0's first step may come
    with torch.inference_mode():
        while True:
            inputs = group.receive_step()
            if inputs is None:
                return
            runner.forward(inputs.to(group.device))


def lora_runtime(loaded, config: LoRAConfig | None, group: ParallelGroup):
    """This rank's LoRA state (None without enable_lora): adapters are read from their
    folders by every rank, checked whole, then cut to the rank's slices."""
    if config is None or not config.enable_lora:
        return None
    from engine.distributed.lora_sharding import lora_sharder
    from engine.lora.runtime import LoRARuntime
    shard = lora_sharder(loaded.hf_config, group.world_size, group.rank)
    return LoRARuntime(loaded.model, config, loaded.dtype, group.device, shard=shard)


def _exit_with_parent() -> None:
    """Linux: the kernel sends SIGTERM to this worker if rank 0's process dies, even by
    SIGKILL, when no Python exit handler runs to stop it. (Strictly, when the *thread*
    that spawned it ends: the engine must be built on the thread that keeps stepping
    it, which the backend's engine loop does for other reasons too.)"""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM))
    except (OSError, AttributeError):  # not Linux: the broken sockets end the worker instead
        pass
