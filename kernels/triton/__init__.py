"""Triton-language GPU kernels (run on CPU only under TRITON_INTERPRET=1) and their launchers."""
