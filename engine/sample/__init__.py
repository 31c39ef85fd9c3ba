"""Turning a step's logits into tokens: per-step sampling tensors and the sampler."""
