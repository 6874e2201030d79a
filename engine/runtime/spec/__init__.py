"""Speculative decoding: drafters that guess the next tokens, checked by the target in one step
(the round logic is in runtime/generate.py, acceptance in runtime/sampler.py)."""
