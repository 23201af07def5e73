"""Listening: uvicorn on a socket bound before anything loads, until SIGTERM / SIGINT (then drain: new requests get
503, those in flight finish within --timeout, exit 0) or an engine failure."""

import asyncio
import logging
import resource
import signal
import socket
import sys

from higgs_trt.runtime.errors import HiggsError

from .app import SpeechService, create_app
from .h11_connection import connection_protocol

log = logging.getLogger("uvicorn.error")

# A new connection must complete its request line and headers within this, or --timeout if shorter (uvicorn times
# out idle keep-alive connections, but not a client that stalls before its first request: it would hold a
# descriptor for ever).
HEADER_SECONDS = 10.0
# Every connection is a file descriptor. Past (the open-file limit − this) connections, a new one is answered 503 and
# closed at once, so a flood of clients cannot take the descriptors the engine, the logs and reference files need;
# this many also covers one event-loop tick's accepts.
DESCRIPTORS_KEPT = 128
# The engine thread lets go of the GIL at every kernel launch, graph replay and event wait and must win it back from
# the event loop's thread each time; under the interpreter's default switch interval (5 ms) each of those waits can
# take that long, which starves the decode loop once requests arrive.
SWITCH_INTERVAL = 0.0005


def raise_open_file_limit() -> int:
    """The soft limit on open files raised to the hard one (each connection takes one), at most 2**20; the limit
    in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (OSError, ValueError):
            pass
    return want if soft == resource.RLIM_INFINITY else soft


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, limit: int) -> None:
    """Out of descriptors anyway (a burst of connections inside one tick), asyncio logs each failed accept with a
    traceback, thousands a second while it lasts: one warning line every 10 s instead."""
    last = -float("inf")

    def handler(loop, context: dict) -> None:
        nonlocal last
        if context.get("message") != "socket.accept() out of system resource":
            loop.default_exception_handler(context)
        elif loop.time() - last >= 10:
            last = loop.time()
            log.warning("cannot accept connections: %s (open-file limit %d); retrying every second",
                        context.get("exception"), limit)

    loop.set_exception_handler(handler)


def run_server(service: SpeechService, host: str, port: int) -> None:
    """Serve until SIGTERM / SIGINT (then drain and return) or an engine failure (HiggsError)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            quiet_accept_errors(asyncio.get_running_loop(), limit)
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            service.draining = True  # new requests get 503 until the listening socket is closed
            super().handle_exit(sig, frame)

    # Bound here, before anything loads, so a taken port is one clear error (uvicorn would log it and exit).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise HiggsError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    limit = raise_open_file_limit()
    protocol = connection_protocol(min(HEADER_SECONDS, service.timeout), max(limit - DESCRIPTORS_KEPT, limit // 2))
    # In-flight requests end by their own --timeout; the grace period only adds time for the last bytes to go out.
    config = uvicorn.Config(create_app(service), http=protocol, timeout_graceful_shutdown=service.timeout + 5,
                            log_level="info")
    log.info("listening on http://%s:%d (/health turns 200 once the engine is loaded and warmed)", host,
             sock.getsockname()[1])
    server = Server(config)
    service.engine.on_failure = lambda: setattr(server, "should_exit", True)
    # uvicorn raises the signal again after its graceful shutdown, under the handler it found: make that one a no-op,
    # so a drained SIGTERM ends with exit code 0.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        server.run(sockets=[sock])
    finally:
        sys.setswitchinterval(interval)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        sock.close()
    if service.engine.failure:
        raise HiggsError(service.engine.failure)
