"""One rank's view of a tensor-parallel group: its rank, and the collectives the sharded
model and the step broadcast need. The torch.distributed process groups live here, in
this object, not in module globals (torch.distributed's own default group aside)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective inside the forward waits this long for the other ranks before it fails:
# a step of max_num_batched_tokens on a busy 2-core host takes ~1 s, so a rank silent for
# this long is stuck or gone.
COMPUTE_TIMEOUT_S = 60.0
# Workers wait this long for rank 0's next step. An idle server sends none for as long
# as no request comes, so this is effectively "forever"; a rank 0 that dies closes its
# sockets, which ends the wait at once.
STEP_WAIT_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelError(RuntimeError):
    """The group cannot run a step: a rank died, stalled, or the setup is refused."""


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where the ranks meet: a FileStore path (no port to pick and race for)."""
    rendezvous_file: str
    world_size: int
    device: str  # "cpu" or "cuda"; a CUDA rank uses cuda:<rank>


class ParallelGroup:
    """Two process groups over the same ranks: `compute` (gloo on CPU, NCCL on CUDA)
    carries the forward's all-reduces and gathers with a bounded timeout; `steps` (gloo,
    host memory) carries rank 0's pickled step inputs, since NCCL moves only device
    tensors and a worker must wait without limit for the next step.

    `fixed_sum_order` (batch-invariant mode): all_reduce adds the ranks' partials in rank
    order on every rank. A ring all-reduce adds each chunk's partials starting at another
    rank and cuts the chunks by the tensor's size, which is the batch's: with 3 or more
    ranks an element's sum would change its order with the batch."""

    def __init__(self, address: GroupAddress, rank: int,
                 compute_timeout_s: float = COMPUTE_TIMEOUT_S,
                 fixed_sum_order: bool = False) -> None:
        self.rank = rank
        self.world_size = address.world_size
        self.fixed_sum_order = fixed_sum_order
        on_cuda = address.device.startswith("cuda")
        self.device = torch.device(f"cuda:{rank}") if on_cuda else torch.device("cpu")
        if on_cuda:
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=compute_timeout_s)
        dist.init_process_group("nccl" if on_cuda else "gloo",
                                init_method=f"file://{address.rendezvous_file}",
                                rank=rank, world_size=self.world_size, timeout=timeout)
        self.compute = dist.group.WORLD
        self.steps = dist.new_group(backend="gloo", timeout=STEP_WAIT_TIMEOUT)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a row-parallel layer's partial products)."""
        tensor = tensor.contiguous()  # gloo and NCCL reduce dense buffers only
        if not self.fixed_sum_order:
            dist.all_reduce(tensor, group=self.compute)
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.compute)
        tensor.copy_(parts[0])
        for part in parts[1:]:  # element-wise: each element's order is the ranks'
            tensor += part
        return tensor

    def all_gather_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, cols] per rank -> [rows, world_size * cols], rank order (vocab slices)."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.compute)
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        """Every rank reached this point (a rank that died before it fails it)."""
        dist.barrier(group=self.compute)

    def send_step(self, payload: object) -> None:
        """Rank 0: hand one object (a step's inputs, or None to stop) to every worker."""
        dist.broadcast_object_list([payload], src=0, group=self.steps)

    def receive_step(self) -> object:
        """A worker: block until rank 0's next send_step and return its object."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.steps)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
