"""The web process's HTTP/1.1 protocol: uvicorn's httptools one, with the request head bounded.

httptools keeps a header's name and value in memory as they arrive, with no bound: one request
of a single 80 MB header, sent by anyone without a token, took 60 MB of a worker's memory, and
three at once took a worker to 600 MB, each answered 200. The request line alone was bounded
(by the parser). So the bytes of each request's head (request line and headers) are counted as
they come, and a head past `SCHEDULER_MAX_HEADER_BYTES` is refused as the parser refuses a bad
request: a 400 in plain text, the connection closed, before the application sees anything.

The count starts with a connection and again after each request's body, and stops at the end of
the head (the blank line); a body is not counted (its own limit is the application's). A chunk
read from the socket that holds the end of one request and the head of the next is counted from
the next request's start only: the bound may be passed by at most one read (256 KB).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

END_OF_HEAD = b"\r\n\r\n"
# How long a refused request's connection is read (and dropped) before it is closed.
LINGER_SECONDS = 2.0


def _drop(data: bytes) -> None:
    return None


class BoundedHeadProtocol(HttpToolsProtocol):
    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._limit = settings.SCHEDULER_MAX_HEADER_BYTES
        self._head_bytes = 0
        self._in_head = True

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            end = data.find(END_OF_HEAD)
            self._head_bytes += len(data) if end < 0 else end
            if self._head_bytes > self._limit:
                self._refuse(f"Request headers larger than {self._limit} bytes.")
                return
        super().data_received(data)

    def _refuse(self, message: str) -> None:
        """Answer 400 and stop reading. Closed at once with the rest of the head unread, the
        connection is reset under the answer, which the client then never reads: what comes
        for a moment more is read and dropped (nothing is kept), then the connection closed."""
        self.logger.warning(message)
        self.transport.write(
            b"".join(
                [
                    STATUS_LINE[400],
                    b"content-type: text/plain; charset=utf-8\r\n",
                    b"content-length: %d\r\n" % len(message),
                    b"connection: close\r\n\r\n",
                    message.encode("ascii"),
                ]
            )
        )
        self.data_received = _drop  # type: ignore[method-assign]
        self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
