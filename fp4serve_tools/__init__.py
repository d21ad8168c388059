"""Offline tooling, not serving code: the NVFP4 checkpoint writer (`fp4serve quantize`) and the GPU
bundle builder (`fp4serve bundle`). It may import engine/; serving code never imports it (the demo
model the server can run lives in engine/weights/demo_model.py)."""
