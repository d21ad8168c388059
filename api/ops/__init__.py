"""What operators read: the web page, /stats, the per-key metrics and /openapi.json."""
