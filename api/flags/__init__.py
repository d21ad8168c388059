"""Groups of `fp4serve serve` flags with their own settings objects, so api/cli.py only calls in."""
