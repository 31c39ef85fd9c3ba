"""Tensor parallelism over torch.distributed: rank 0 is the engine's process (scheduler,
sampler, the step loop), ranks 1..N-1 are spawned workers that run only the forward."""
