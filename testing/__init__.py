"""Helpers shared by tests/ and bench/: tiny random models, paged batches, a fake model
runner and the scheduler's invariants. Nothing here is imported by the engine itself."""
