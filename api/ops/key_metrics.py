"""`GET /metrics/keys`: the per-key Prometheus series (engine/front/metrics.py `key_registry`: tokens,
finished requests and TTFT by API key name), for an admin key only. `/metrics` stays open and
aggregate, as vLLM's is, so probes and routers scrape it with no secret; per-key usage follows
/v1/usage's rule instead (a user key sees only its own row there, and nothing here). Prometheus
scrapes it with `authorization: {credentials: <admin key>}` in the job's scrape config."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.access.keys import token_from_headers, unauthorized_message
from api.errors import APIError
from api.http import server_state


async def key_metrics(request: Request) -> Response:
    state = server_state(request)
    token, sent = token_from_headers(request.scope["headers"])
    record = state.keys.lookup(token)
    if record is None:
        raise APIError(401, unauthorized_message(sent), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if not record.admin:
        raise APIError(
            403,
            f"key {record.name!r} is not an admin key: per-key metrics need one",
            code="permission_denied",
            type_="permission_error",
        )
    engine = state.engine or state.ready_engine()  # as /metrics: served while draining, 503 before loading
    return Response(generate_latest(engine.metrics.key_registry), media_type=CONTENT_TYPE_LATEST)


def key_metrics_routes() -> list[Route]:
    return [Route("/metrics/keys", key_metrics, methods=["GET"])]
