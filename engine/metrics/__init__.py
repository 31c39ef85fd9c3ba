"""What the engine records about its work: the workload trace."""
