"""Torch-free scheduling: requests, the waiting queue, the scheduler, stop checks and the paged KV cache."""
