"""Anthropic's Messages API: its request model and mapping, and its routes and event encoder."""
