"""Headless Chromium for the tests, driven through its DevTools protocol over
a pipe (``--remote-debugging-pipe``: JSON messages ending in NUL on file
descriptors 3 and 4), with the standard library only: open a file, gather
console errors, uncaught exceptions and every request, take a screenshot;
and a PNG reader to count a screenshot's colours."""
import base64
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from typing import Dict, List, Optional

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1280,1600", "about:blank")


class Page:
    """What a page did while it loaded: ``errors`` (console errors and
    uncaught exceptions), ``requests`` (every URL it asked for) and its
    ``screenshot`` (PNG bytes)."""

    def __init__(self) -> None:
        self.errors: List[str] = []
        self.requests: List[str] = []
        self.screenshot = b""


class _Pipe:
    def __init__(self, timeout_s: float) -> None:
        to_child, self._send = os.pipe()
        self._receive, from_child = os.pipe()
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")

        def fds():  # the child's 3 reads our messages, its 4 writes its own
            reads, writes = os.dup(to_child), os.dup(from_child)  # above 3 and 4
            os.dup2(reads, 3)
            os.dup2(writes, 4)
        self.process = subprocess.Popen(
            [CHROMIUM, f"--user-data-dir={self.profile}", *FLAGS], preexec_fn=fds,
            pass_fds=(3, 4), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_child)
        os.close(from_child)
        self.deadline = time.monotonic() + timeout_s
        self.buffer, self.next_id, self.events = b"", 0, []

    def call(self, method: str, session: Optional[str] = None, **params) -> Dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._send, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def _read(self) -> Dict:
        while b"\0" not in self.buffer:
            if time.monotonic() > self.deadline:
                raise TimeoutError("chromium did not answer in time")
            chunk = os.read(self._receive, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed its DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        os.close(self._send)
        os.close(self._receive)
        shutil.rmtree(self.profile, ignore_errors=True)


def load(path: str, timeout_s: float = 60.0) -> Page:
    """Open ``path`` in headless Chromium; what it did, and a full-page screenshot."""
    pipe, page = _Pipe(timeout_s), Page()
    try:
        target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
        session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            pipe.call(f"{domain}.enable", session)
        pipe.call("Page.navigate", session, url="file://" + os.path.abspath(path))
        while not any(e.get("method") == "Page.loadEventFired" for e in pipe.events):
            pipe.events.append(pipe._read())  # pylint: disable=protected-access
        pipe.call("Runtime.evaluate", session, expression="1")  # events before it are in
        metrics = pipe.call("Page.getLayoutMetrics", session)["cssContentSize"]
        shot = pipe.call("Page.captureScreenshot", session, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": 1280,
                               "height": min(metrics["height"], 4000), "scale": 1})
        page.screenshot = base64.b64decode(shot["data"])
    finally:
        pipe.close()
    for event in pipe.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.requestWillBeSent":
            page.requests.append(params["request"]["url"])
        elif method == "Runtime.exceptionThrown":
            page.errors.append(params["exceptionDetails"].get("text", "exception"))
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            page.errors.append(str([a.get("value") for a in params["args"]]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            page.errors.append(params["entry"]["text"])
    return page


def colours(png: bytes) -> int:
    """Distinct colours of an 8-bit RGB or RGBA PNG (non-interlaced)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, data, header = 8, b"", None
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        chunk = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            data += chunk
        pos += 12 + length
    width, height, depth, kind, _, _, interlace = header
    assert depth == 8 and kind in (2, 6) and not interlace, header
    step = 3 if kind == 2 else 4
    raw, stride = zlib.decompress(data), width * step
    previous, seen = bytearray(stride), set()
    for y in range(height):
        line = raw[y * (stride + 1):(y + 1) * (stride + 1)]
        row = _unfilter(line[0], bytearray(line[1:]), previous, step)
        seen.update(bytes(row[i:i + step]) for i in range(0, stride, step * 7))
        previous = row
    return len(seen)


def _unfilter(kind: int, row: bytearray, up: bytearray, step: int) -> bytearray:
    """One PNG scanline with its filter undone (PNG spec §9)."""
    for i in range(len(row)):
        left = row[i - step] if i >= step else 0
        corner = up[i - step] if i >= step else 0
        if kind == 1:
            row[i] = (row[i] + left) & 255
        elif kind == 2:
            row[i] = (row[i] + up[i]) & 255
        elif kind == 3:
            row[i] = (row[i] + (left + up[i]) // 2) & 255
        elif kind == 4:
            p = left + up[i] - corner
            pa, pb, pc = abs(p - left), abs(p - up[i]), abs(p - corner)
            row[i] = (row[i] + (left if pa <= pb and pa <= pc else up[i] if pb <= pc
                                else corner)) & 255
    return row
