"""What a checkpoint's config files say, read into frozen configs: config.json's model
(`model_config.py`), its hybrid and MoE sections (`hybrid_config.py`, `moe_config.py`) and
generation_config.json's defaults (`generation_config.py`)."""
