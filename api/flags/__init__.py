"""Every `fp4serve serve` flag, by topic, each module with the settings its flags give; serve.py
adds them all and maps them onto EngineConfig and ServerConfig, so api/cli.py only calls in."""
