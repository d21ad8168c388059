"""Where weights come from and how they reach the model: what --model names (folders, GGUF, the
demo), checkpoint files and tensor names, the loader and its plan, the dtype policy."""
