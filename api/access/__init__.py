"""Who may call and how much: API keys and credentials, request limits, rate limits, and the
request log of refusals."""
