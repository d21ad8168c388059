"""OpenAI's chat and completions responses (the pipeline's encoders and the pieces they share), and
vLLM's /tokenize and /detokenize."""
