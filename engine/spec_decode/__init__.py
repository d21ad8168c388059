"""Speculative decoding: drafters propose tokens (ngram.py; mtp.py, the checkpoint's MTP head, run
by the model runner), the scheduler runs them as extra query tokens of their request in the ordinary
mixed forward, and rejection.py keeps the prefix the target model agrees with plus one token of its
own."""
