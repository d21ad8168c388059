"""Weight formats, one file each: NVFP4, int8, int4, packed bf16, FP8 linears and their builders,
and GGUF files as HF folders."""
