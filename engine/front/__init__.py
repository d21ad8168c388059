"""The engine's front, in the server's process: AsyncEngine, the input and output processors, the
tokenizer and detokenizer, admission, the metrics and the offline driver. Text lives here;
the core below speaks token ids."""
