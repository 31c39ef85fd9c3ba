"""Structured outputs with xgrammar: grammar compiling and following, and the sampler's token mask."""
