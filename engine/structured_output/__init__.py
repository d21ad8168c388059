"""Grammar-constrained decoding: the compiled grammars (by bytes, compiled off the step thread)
and the per-request matchers and token bitmasks."""
