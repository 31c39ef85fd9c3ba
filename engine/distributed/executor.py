"""Rank 0's side of tensor parallelism: start the workers, shard this process's model,
broadcast every step's inputs, notice dead workers, stop the workers on close or exit."""
from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as torch_mp

from engine.config import EngineConfig
from engine.worker.model_runner import StepInputs
from engine.distributed.group import (COMPUTE_TIMEOUT_S, GroupAddress, ParallelGroup,
                                   TensorParallelError)
from engine.distributed.sharding import (check_shardable, expert_parallel_applies,
                                         shard_loaded)
from engine.distributed.worker import CacheSetup, WorkerSpec, run_worker

logger = logging.getLogger(__name__)

# After a collective fails, how long to wait for the worker that caused it to be seen
# dead (a killed process becomes reapable a moment after its sockets close).
_DEATH_NOTICE_S = 2.0
# close(): how long workers get to leave on their own before SIGTERM, then SIGKILL.
_STOP_GRACE_S = 5.0


@dataclass
class _Workers:
    """What close() and the exit-time finalizer need; no reference back to the executor,
    so the finalizer does not keep it alive."""
    processes: list
    rendezvous_dir: str
    group: ParallelGroup | None = None
    healthy: bool = True
    closed: bool = field(default=False)

    def stop(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.group is not None and self.healthy and self.alive():
            try:
                self.group.send_step(None)
            except Exception:  # noqa: BLE001 - they are terminated below either way
                pass
        deadline = time.monotonic() + _STOP_GRACE_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(1.0)
            if process.is_alive():
                process.kill()
                process.join(1.0)
        if self.group is not None:
            self.group.close()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, loaded_config, model_dir: str, num_threads: int,
                 compute_timeout_s: float = COMPUTE_TIMEOUT_S) -> None:
        """Checks that the model splits `config.tensor_parallel_size` ways (ValueError if
        not, before anything starts), spawns the workers and joins them as rank 0."""
        world = config.tensor_parallel_size
        self.expert_parallel = expert_parallel_applies(loaded_config, world,
                                                       config.enable_expert_parallel)
        check_shardable(loaded_config, world, self.expert_parallel)
        device = config.torch_device
        if device.startswith("cuda") and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size {world} needs {world} GPUs; "
                             f"{torch.cuda.device_count()} visible")
        rendezvous_dir = tempfile.mkdtemp(prefix="tle-tp-")
        address = GroupAddress(os.path.join(rendezvous_dir, "rendezvous"), world,
                               "cuda" if device.startswith("cuda") else "cpu")
        context = torch_mp.get_context("spawn")
        _use_python_for_spawn(context)
        processes = [context.Process(
            target=run_worker, name=f"tle-tp-rank{rank}", daemon=True,
            args=(WorkerSpec(address, rank, model_dir, config.dtype, config.tokenizer,
                             num_threads, compute_timeout_s,
                             config.lora if config.lora.enable_lora else None,
                             config.batch_invariant, config.model_impl,
                             config.disable_sliding_window, self.expert_parallel),))
            for rank in range(1, world)]
        self._workers = _Workers(processes, rendezvous_dir)
        self.batch_invariant = config.batch_invariant
        self.failure: str | None = None
        # Also at interpreter exit or when the engine is garbage-collected unclosed.
        self._finalizer = weakref.finalize(self, self._workers.stop)
        for process in processes:
            process.start()
        try:
            self.group = self._join(address, compute_timeout_s)
        except BaseException:
            self.close()
            raise
        self._workers.group = self.group
        logger.info("tensor parallel: %d ranks (%s)%s, worker pids %s", world,
                    "NCCL" if address.device == "cuda" else "gloo",
                    ", experts placed whole" if self.expert_parallel else "",
                    [p.pid for p in processes])

    def _join(self, address: GroupAddress, timeout_s: float) -> ParallelGroup:
        """Rank 0's rendezvous, on a helper thread so that a worker dying before it
        joins (a failed import, a bad model) is reported at once rather than after the
        rendezvous timeout."""
        outcome: dict[str, object] = {}

        def join() -> None:
            try:
                outcome["group"] = ParallelGroup(address, 0, timeout_s,
                                                 fixed_sum_order=self.batch_invariant)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                outcome["error"] = exc

        thread = threading.Thread(target=join, name="tle-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = self._dead_workers()
            if dead and thread.is_alive():
                self._fail(dead)
                raise TensorParallelError(f"{self.failure} (during start-up; its stderr "
                                          "says why)")
        if "error" in outcome:
            error = outcome["error"]
            raise TensorParallelError(f"tensor-parallel workers did not join: {error}") from error
        return outcome["group"]

    @property
    def workers(self) -> list:
        """The worker processes (multiprocessing.Process), rank 1 first."""
        return list(self._workers.processes)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def shard(self, loaded):
        """This process's model cut down to rank 0's slices (see engine/distributed/sharding.py)."""
        return shard_loaded(loaded, self.group, self.batch_invariant, self.expert_parallel)

    def start(self, setup: CacheSetup) -> None:
        """Tell the workers the KV pool and wait until each has its model and cache."""
        self.send_step(setup)
        try:
            self.group.barrier()
        except Exception as exc:
            raise self.explain(exc) from exc

    def send_step(self, payload: StepInputs | CacheSetup) -> None:
        self.check_alive()
        if isinstance(payload, StepInputs) and self.group.device.type != "cpu":
            payload = payload.to(torch.device("cpu"))  # pickled from host memory
        try:
            self.group.send_step(payload)
        except Exception as exc:
            raise self.explain(exc) from exc

    def check_alive(self) -> None:
        if self.failure is None:
            dead = self._dead_workers()
            if dead:
                self._fail(dead)
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def explain(self, exc: BaseException) -> BaseException:
        """A failed step's exception, as a TensorParallelError when the group is at fault
        (a worker died, or a collective failed or timed out); `exc` itself otherwise."""
        if isinstance(exc, TensorParallelError):
            return exc
        deadline = time.monotonic() + _DEATH_NOTICE_S
        collective = _is_collective_error(exc)
        while collective and not self._dead_workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self._dead_workers()
        if dead:
            self._fail(dead)
        elif collective:
            self.failure = f"tensor-parallel collective failed (a rank stalled?): {exc}"
            self._workers.healthy = False
        else:
            return exc
        error = TensorParallelError(self.failure)
        error.__cause__ = exc
        return error

    def close(self) -> None:
        self._finalizer()

    def _dead_workers(self) -> list:
        return [p for p in self._workers.processes if not p.is_alive()]

    def _fail(self, dead: list) -> None:
        named = ", ".join(f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in dead)
        self.failure = (f"tensor-parallel worker died: {named}; the engine cannot run "
                        "steps any more and must be restarted")
        self._workers.healthy = False
        logger.error("%s", self.failure)


def _is_collective_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(exc)
    return any(word in text for word in ("Gloo", "gloo", "NCCL", "Connection", "Timed out"))


def _use_python_for_spawn(context) -> None:
    """Spawned workers start `sys.executable`; inside Triton's Python backend that is
    the stub binary, not a Python, so point spawn at the interpreter it embeds (the
    child still gets the parent's sys.path, so the same packages load)."""
    exe = os.path.basename(sys.executable or "")
    if exe.startswith("python"):
        return
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (os.path.join(sys.exec_prefix, "bin", version),
                      os.path.join(sys.prefix, "bin", version), shutil.which(version),
                      shutil.which("python3")):
        if candidate and os.access(candidate, os.X_OK):
            context.set_executable(candidate)
            return
