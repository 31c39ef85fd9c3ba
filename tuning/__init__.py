"""Replay recorded workloads (engine/metrics/trace.py) on the real scheduler and KV-cache
manager with a calibrated step-time model, no model execution; tune engine knobs for a
latency target. Needs neither Triton nor torch kernels nor a model, except to record a
trace: tuning.workload drives a synthetic workload through the real engine."""
