"""What the engine tells the outside of its KV cache: vLLM's KV-cache events with their block
hashes, and the prefix-cache feed that data parallel places requests by."""
