"""A tiny Chrome DevTools Protocol client over ``--remote-debugging-pipe`` (no websocket, no PyPI package).

Chromium reads NUL-terminated JSON commands from file descriptor 3 and writes replies and events to
descriptor 4. Every host name resolves to nothing (``--host-resolver-rules``), so a page cannot reach
the network even by mistake; the tests also record every request the page makes.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--mute-audio",
    "--disable-dev-shm-usage",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--proxy-server=127.0.0.1:9",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    return os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with one page; ``call`` sends a command to that page and waits for its reply."""

    def __init__(self, executable: str, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self.profile = tempfile.mkdtemp(prefix="fa-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Move both child ends above 10, so placing them on 3 and 4 in the child cannot clobber one another.
        child_r = os.dup2(to_browser_r, 10 + to_browser_r) if to_browser_r < 10 else to_browser_r
        child_w = os.dup2(from_browser_w, 11 + from_browser_w) if from_browser_w < 11 else from_browser_w

        def place_fds() -> None:
            os.dup2(child_r, 3)
            os.dup2(child_w, 4)

        self.proc = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={self.profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=place_fds,
            pass_fds=(3, 4),
        )
        for fd in {to_browser_r, from_browser_w, child_r, child_w}:
            os.close(fd)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._from_browser], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("no reply from chromium")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, event: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for k, seen in enumerate(self.events):
                if seen.get("method") == event:
                    return self.events.pop(k)
            self.events.append(self._read_message(deadline))

    def open(self, path: Path, width: int = 1200, height: int = 900) -> None:
        for domain in ("Page.enable", "Network.enable", "Runtime.enable"):
            self.call(domain)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        self.call("Page.navigate", {"url": path.resolve().as_uri()})
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"page raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the centre of the element."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1}
            )

    def press(self, key: str) -> None:
        codes = {"ArrowLeft": 37, "ArrowRight": 39, "Tab": 9, "Enter": 13}
        text = {"Enter": "\r"}  # a key with text is typed: Enter on a focused button presses it
        for kind in ("keyDown", "keyUp"):
            event = {"type": kind, "key": key, "code": key, "windowsVirtualKeyCode": codes[key]}
            if kind == "keyDown" and key in text:
                event["text"] = text[key]
            self.call("Input.dispatchKeyEvent", event)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def close(self) -> None:
        try:
            self.session = None
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)
