"""uvicorn's h11 protocol with three additions uvicorn lacks. It subclasses uvicorn internals (H11Protocol's
connection_made / data_received and its `connections`, `cycle`, `transport`, `loop` and keep-alive attributes), so
pyproject.toml pins the uvicorn release it was written against, and tests/test_server.py fails when they change."""

import json

from .speech_api import ApiError


def connection_protocol(header_seconds: float, max_connections: int):
    """uvicorn's h11 protocol, (a) closing a connection whose first request line and headers have not arrived within
    `header_seconds` (uvicorn's own timeout covers only idle keep-alive connections), (b) answering 503 and closing
    any connection past `max_connections` open at once, (c) keeping the keep-alive timeout for a connection whose
    request body arrives after its answer."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    error = ApiError(503, f"the server has {max_connections} connections open; retry shortly", None,
                     "too_many_connections", "server_error")
    content = json.dumps(error.body()).encode()
    overloaded = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(content), content))

    class Connection(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(overloaded)
                transport.close()
                return
            self.loop.call_later(header_seconds, self._drop_before_first_request)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # uvicorn arms its keep-alive timeout when a response completes and cancels it at every read: the rest of
            # a body that arrives after an early answer (a 405, a 429) left the connection idle with no timeout at all
            if (self.cycle is not None and self.cycle.response_complete and self.timeout_keep_alive_task is None
                    and not self.transport.is_closing()):
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)

        def _drop_before_first_request(self) -> None:
            upgraded = self.transport.get_protocol() is not self  # a WebSocket now owns the connection
            if self.cycle is None and not upgraded and not self.transport.is_closing():
                self.transport.close()

    return Connection
