"""`serve --api-key`: every route but /health needs `Authorization: Bearer KEY` (what the openai client sends), else
401 in OpenAI's error shape; a WebSocket without it is closed before it is accepted. The key is compared in constant
time."""

import hmac
import json

OPEN_PATHS = ("/health",)
CLOSE_UNAUTHORIZED = 1008  # WebSocket close code: policy violation


class BearerAuth:
    """ASGI middleware in front of the app."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, b"Bearer " + key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS and not self._allowed(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": CLOSE_UNAUTHORIZED})
            else:
                await _unauthorized(send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope) -> bool:
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)


async def _unauthorized(send) -> None:
    body = json.dumps({"error": {"message": "missing or incorrect API key: send Authorization: Bearer KEY",
                                 "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": body})
