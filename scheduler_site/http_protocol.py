"""The web process's HTTP/1.1 protocol: uvicorn's httptools one, with the request head bounded.

httptools keeps a header's name and value in memory as they arrive, with no bound: one request
of a single 80 MB header, sent by anyone without a token, took 60 MB of a worker's memory, and
three at once took a worker to 600 MB, each answered 200. The request line alone was bounded
(by the parser). So the bytes of each request's head (request line and headers) are counted as
they come, and a head past `SCHEDULER_MAX_HEADER_BYTES` is refused as the parser refuses a bad
request: a 400 in plain text, before the application sees anything.

Each read is counted before the parser sees it, up to the blank line that ends the head (found
across two reads too), so a body is not counted (its own limit is the application's). Counting
starts again after each request; a read that holds the end of one request and the head of the
next is counted from the next read on, so a pipelined head may pass the bound by one read
(256 KB). A refused connection is read and dropped for a moment before it is closed (closed
with bytes unread, it is reset under the answer, which the client then never reads), and the
400 waits for the answers to the requests before it on the connection (pipelined), which it
would otherwise overtake.
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
        self._tail = b""  # the last bytes of the head read so far (a blank line split)
        self._refusal = ""

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            # Up to the blank line that ends the head, found across the last read's end too.
            joined = self._tail + data
            end = joined.find(END_OF_HEAD)
            if end < 0:
                # Not the bytes that may begin the blank line: a head is counted the same
                # however its writes were split.
                begun = next((n for n in (3, 2, 1) if joined.endswith(END_OF_HEAD[:n])), 0)
                counted = len(data) - min(begun, len(data))
            else:
                counted = max(0, end - len(self._tail))
            self._head_bytes += counted
            self._tail = joined[-3:]
            if self._head_bytes > self._limit:
                self._refuse(f"Request headers larger than {self._limit} bytes.")
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._tail = b""
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_bytes, self._tail = True, 0, b""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refusal and not self._answering():
            self._send_refusal()

    def _answering(self) -> bool:
        """Whether a request before the refused one is still being answered, or waits to be."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _refuse(self, message: str) -> None:
        self.logger.warning(message)
        self.data_received = _drop  # type: ignore[method-assign]
        self._refusal = message
        if not self._answering():
            self._send_refusal()

    def _send_refusal(self) -> None:
        """The 400 of `send_400_response`, with its close put off (LINGER_SECONDS)."""
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content.extend([name, b": ", value, b"\r\n"])
        message = self._refusal.encode("ascii")
        content.extend(
            [
                b"content-type: text/plain; charset=utf-8\r\n",
                b"content-length: %d\r\n" % len(message),
                b"connection: close\r\n\r\n",
                message,
            ]
        )
        self.transport.write(b"".join(content))
        self._refusal = ""
        self.loop.call_later(LINGER_SECONDS, self.transport.close)
