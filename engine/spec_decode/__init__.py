"""Speculative decoding (vLLM V1's spec_decode): proposers guess a request's next tokens
between steps, the scheduler schedules them with the request's own (num_tokens_with_spec),
one forward scores every proposed position and the sampler keeps the longest prefix the
target model agrees with, plus one token of its own (engine/sample/rejection.py).

Torch-free except draft_model.py, which runs a second model: the scheduler imports the
counters from here."""
