"""A real HTTP server on 127.0.0.1 whose answers a test writes: the SDK's transport is tested on
real sockets and real keep-alive connections, not on a stand-in of its HTTP library."""

from __future__ import annotations

import itertools
import json
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Request:
    """What the server received."""

    method: str
    path: str  # with its query string
    headers: dict[str, str]  # names lower-cased
    content: bytes
    connection: int  # the TCP connection it came on, numbered from 0 in order of arrival
    at: float = field(default_factory=time.monotonic)  # when it was read

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass(frozen=True)
class Response:
    """What the server answers. `hang_up`: close the connection without answering;
    `close_after`: answer, then close the connection without saying so (as a server does when
    its keep-alive timeout passes); `body_after_hangup`: send the headers, wait for the client
    to hang up its sending half, then send the body and close (an answer whose body was still
    on its way when the client stopped); `hold_body`: send the headers, wait for the event,
    then send the body in two pieces a moment apart (read in two reads)."""

    status: int = 200
    content: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    hang_up: bool = False
    close_after: bool = False
    body_after_hangup: bool = False
    hold_body: threading.Event | None = None


def json_response(status: int, body: Any, **headers: str) -> Response:
    return Response(
        status, json.dumps(body).encode(), {"Content-Type": "application/json"} | headers
    )


HANG_UP = Response(hang_up=True)


class ScriptedServer:
    """Answers each request with `handle(request)`; keeps every request in `seen`. Over TLS
    with `tls`, a server context."""

    def __init__(
        self, handle: Callable[[Request], Response], tls: ssl.SSLContext | None = None
    ) -> None:
        self.seen: list[Request] = []
        # For `body_after_hangup` and `hold_body` answers: set once the headers are sent; then
        # what the client sent before hanging up (b"" when it only hung up).
        self.headers_sent = threading.Event()
        self.before_hangup: list[bytes] = []
        connections = itertools.count()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the scheduler's server

            def setup(self) -> None:
                super().setup()
                self.connection_number = next(connections)

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(
                    self.command,
                    self.path,
                    {name.lower(): value for name, value in self.headers.items()},
                    self.rfile.read(length),
                    self.connection_number,
                )
                server.seen.append(request)
                response = handle(request)
                if response.hang_up:
                    self.close_connection = True
                    return
                self.send_response(response.status)
                for name, value in response.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(response.content)))
                self.end_headers()
                if response.body_after_hangup:
                    server.headers_sent.set()
                    self.connection.settimeout(30)
                    server.before_hangup.append(self.rfile.read())  # up to the client's FIN
                    self.close_connection = True
                if response.hold_body is not None:
                    server.headers_sent.set()
                    response.hold_body.wait(30)
                    self.wfile.write(response.content[:10])
                    time.sleep(0.2)
                    self.wfile.write(response.content[10:])
                    return
                self.wfile.write(response.content)
                if response.close_after:
                    self.wfile.flush()
                    self.close_connection = True

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
