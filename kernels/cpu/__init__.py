"""CPU kernels: feature detection, the native C kernels (built on first use) and their wrappers."""
