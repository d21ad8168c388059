"""Offline tooling, not serving code: the embedded demo model and the offline Qwen tokenizer it
ships with, the NVFP4 checkpoint writer (`fp4serve quantize`) and the GPU bundle builder
(`fp4serve bundle`). The server reaches the demo only through engine/model_path.py."""
