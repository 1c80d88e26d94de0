"""A streamed completion read event by event as it comes (http.client: the test sees the bytes a client gets)."""

from __future__ import annotations

import http.client
import json
import urllib.parse


class LiveStream:
    """A streamed completion read event by event as it comes, through the router."""

    def __init__(self, url: str, body: dict) -> None:
        address = urllib.parse.urlsplit(url)
        self.connection = http.client.HTTPConnection(address.hostname, address.port, timeout=120)
        self.connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        self.response = self.connection.getresponse()
        assert self.response.status == 200, self.response.read()
        self.chunks: list[dict] = []
        self.done = False

    def read_event(self) -> dict | None:
        """The next data event's object (None at [DONE]); comments are skipped."""
        lines = []
        while True:
            line = self.response.readline()
            assert line, "the stream ended before [DONE]"
            if line == b"\n":
                break
            lines.append(line.rstrip(b"\n"))
        event = b"\n".join(lines)
        assert not event.startswith(b":"), f"a router-only comment reached the client: {event[:80]!r}"
        assert event.startswith(b"data: "), event
        if event == b"data: [DONE]":
            self.done = True
            return None
        value = json.loads(event[6:])
        assert "error" not in value, value
        self.chunks.append(value)
        return value

    def read_all(self) -> None:
        while self.read_event() is not None:
            pass
        self.connection.close()

    @property
    def text(self) -> str:
        return "".join(choice["text"] for chunk in self.chunks for choice in chunk["choices"])

    @property
    def usage(self) -> dict:
        return self.chunks[-1]["usage"]
