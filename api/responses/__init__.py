"""OpenAI's Responses API: its request model and mapping, its output events, its routes, the
response store and its tools."""
