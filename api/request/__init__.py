"""The typed request every protocol maps into: OpenAI's chat and completions models, the chat
messages and tools, and the validation base every protocol's models share."""
