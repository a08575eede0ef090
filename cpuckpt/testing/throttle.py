"""A throttling S3 proxy for tests: a tiny HTTP server on 127.0.0.1 in front of a real S3 endpoint (the
SeaweedFS test server) that answers chosen requests with S3's own ``503 SlowDown`` error and forwards every
other request unchanged.

Requests are forwarded byte for byte with the client's ``Host`` header, so their SigV4 signatures stay valid
at the server. :class:`ThrottlingProxy` throttles the first ``n`` requests that ``match`` (default: every
``UploadPart``, a PUT with ``partNumber`` in its query); ``n=None`` throttles them all. Every socket it opens
has a timeout, and :meth:`ThrottlingProxy.stop` shuts the server down: nothing here waits unbounded.

Nothing here is imported by the product.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["SLOW_DOWN_XML", "ThrottlingProxy", "upload_part"]

logger = logging.getLogger(__name__)

Match = Callable[[str, str, dict[str, list[str]]], bool]  # (method, path, query) -> throttle it?

SLOW_DOWN_XML = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message><RequestId>cpuckpt-test</RequestId></Error>")

# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the proxy sets itself.
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade", "expect",
        "content-length"}


def upload_part(method: str, path: str, query: dict[str, list[str]]) -> bool:
    """An S3 ``UploadPart`` request."""
    return method == "PUT" and "partNumber" in query


class ThrottlingProxy:
    """Forward to ``upstream`` (``http://host:port``); answer the first ``n`` requests that ``match`` with 503
    SlowDown (all of them when ``n`` is None). :attr:`throttled` and :attr:`forwarded` count the requests."""

    def __init__(self, upstream: str, *, n: int | None, match: Match = upload_part, timeout_s: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream {upstream!r}: give http://host:port")
        self.upstream = (parts.hostname, parts.port)
        self.remaining = n
        self.match = match
        self.timeout_s = timeout_s
        self.throttled = 0
        self.forwarded = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def take(self, method: str, path: str, query: dict[str, list[str]]) -> bool:
        """Whether to throttle this request (counts it)."""
        if not self.match(method, path, query):
            return False
        with self._lock:
            if self.remaining is not None:
                if self.remaining <= 0:
                    return False
                self.remaining -= 1
            self.throttled += 1
        return True

    def start(self) -> ThrottlingProxy:
        proxy = self

        class Handler(_Handler):
            owner = proxy

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="throttling-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (idempotent)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(10)

    def __enter__(self) -> ThrottlingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, and "100 Continue" for the client's Expect header
    timeout = 30  # an idle client connection ends after this
    owner: ThrottlingProxy

    def setup(self) -> None:
        super().setup()
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("proxy: " + format, *args)

    def do_GET(self) -> None:  # http.server calls do_<METHOD>
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _proxy(self) -> None:
        if self.headers.get("Transfer-Encoding"):
            self._answer(501, b"chunked request bodies are not supported by this test proxy", close=True)
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        split = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(split.query, keep_blank_values=True)
        if self.owner.take(self.command, split.path, query):
            logger.info("proxy: throttling %s %s", self.command, split.path)
            self._answer(503, SLOW_DOWN_XML, content_type="application/xml")
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if length or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(length)
        try:
            if self._upstream is None:
                self._upstream = http.client.HTTPConnection(*self.owner.upstream, timeout=self.owner.timeout_s)
            self._upstream.request(self.command, self.path, body=body if length else None, headers=headers)
            resp = self._upstream.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            if self._upstream is not None:
                self._upstream.close()
                self._upstream = None
            self._answer(502, f"upstream: {e}".encode(), close=True)
            return
        with self.owner._lock:
            self.owner.forwarded += 1
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        if self.command == "HEAD":  # no body: the object's length, as the server said it
            if resp.getheader("Content-Length") is not None:
                self.send_header("Content-Length", resp.getheader("Content-Length"))
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _answer(self, status: int, body: bytes, *, content_type: str = "text/plain", close: bool = False) -> None:
        self.send_response_only(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
