"""What every request passes before the app sees it: the API key, and the body size limit.

The limit is enforced on the bytes as they arrive, before any parsing: a Content-Length above it is answered 413
without reading the body, and a body sent in chunks is read only up to the limit. tritonserver 2.51's own HTTP front
end crashes on bodies of about 4.19 MB, so the default stays far below that, and the front never forwards a prompt
that large. /health stays open without a key, for probes.
"""

from __future__ import annotations

import hmac
import json
from http import HTTPStatus

from .errors import error_body

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
OPEN_PATHS = ("/health",)


class RequestGuard:
    """ASGI middleware."""

    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.lower(): value for name, value in scope["headers"]}
        if self.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(headers):
            return await _answer(send, HTTPStatus.UNAUTHORIZED, error_body(
                "a valid API key is required: send it as 'Authorization: Bearer KEY'", HTTPStatus.UNAUTHORIZED,
                code="invalid_api_key"), {b"www-authenticate": b"Bearer"})
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return await self._too_large(send)
        body, messages = 0, []
        while True:  # the whole body, up to the limit, before the app parses any of it
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += len(message.get("body", b""))
            if body > self.max_body_bytes:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def _too_large(self, send):
        await _answer(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, error_body(
            f"the request body exceeds {self.max_body_bytes} bytes", HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            code="request_too_large"))


async def _answer(send, status: HTTPStatus, body: dict, extra_headers: dict[bytes, bytes] | None = None) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *(extra_headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
