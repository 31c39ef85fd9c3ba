"""Torch-free output handling: detokenizing, stop strings, n > 1 sequences, and what to send when."""
