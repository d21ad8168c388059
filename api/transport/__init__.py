"""The HTTP mechanics below every route: body framing, the client watch, requests in flight and
their deadlines, SSE, the HTTP-side metrics and hypercorn's HTTP/2 mends."""
