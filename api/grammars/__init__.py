"""Grammars from the request: tool_choice and JSON schemas as xgrammar EBNF, response_format."""
