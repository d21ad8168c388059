"""The built-in web page (chat playground and live dashboard): `GET /` and its files under `/ui/`,
plain HTML, ES modules and CSS shipped in api/static/ (no build step, nothing fetched from
elsewhere), each served with a strict Content-Security-Policy. `--no-ui` leaves these routes out."""

from __future__ import annotations

import importlib.resources
import logging
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

logger = logging.getLogger("fp4serve")

UI_PREFIX = "/ui/"
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Everything from this origin only, no inline script or style, no plugins, no framing. Trusted
# Types make the browser refuse any string written to innerHTML and its kin, so model output
# can never be parsed as HTML even by a future mistake in the page's code.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "img-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    )
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated each load, so an upgraded server's page is never stale
}


@dataclass(frozen=True)
class StaticFile:
    body: bytes
    media_type: str

    def response(self) -> Response:
        return Response(self.body, media_type=self.media_type, headers=SECURITY_HEADERS)


def load_static_files() -> dict[str, StaticFile]:
    """Every file of api/static/ by name, read once (they are a few tens of kB)."""
    folder = importlib.resources.files("api") / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if entry.is_file() and suffix in _MEDIA_TYPES:
            files[entry.name] = StaticFile(entry.read_bytes(), _MEDIA_TYPES[suffix])
    assert "index.html" in files, "api/static/index.html is missing from the package"
    return files


def ui_routes(base_url: str) -> list[Route]:
    files = load_static_files()
    page = files["index.html"]
    logger.info(
        "web page (chat playground, live dashboard) at %s/ from %d files; --no-ui turns it off", base_url, len(files)
    )

    async def index(request: Request) -> Response:
        return page.response()

    async def static(request: Request) -> Response:
        found = files.get(request.path_params["name"])
        if found is None:
            return Response("not found", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)
        return found.response()

    return [
        Route("/", index, methods=["GET"]),
        Route(UI_PREFIX + "{name}", static, methods=["GET"]),
    ]
