"""Headless Chromium driven over the Chrome DevTools protocol, standard library only.

The protocol travels over two pipes (``--remote-debugging-pipe``: Chromium reads commands on its fd 3 and
writes answers and events on its fd 4, each message JSON ended by a NUL byte), so no websocket client and
no port are needed. The browser starts with every network request doomed: host names resolve to nothing
(``--host-resolver-rules``) and every http(s) request goes to a proxy that refuses connections, so a page
that tried to load something still loads, and :class:`Page` records the attempt (the protocol's
``Network.requestWillBeSent`` events).

:func:`find_chromium` is Debian's ``chromium`` (``make browser`` installs it) or another Chromium on the
``PATH``; None where there is none, and the browser tests skip.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
"""The programs looked for, in this order."""

WAIT_S = 20.0
"""The longest wait for one answer or event: a headless start and a small page take well under 2 s on
2 CPU cores; a browser that died ends the wait at once (its pipe closes)."""

NO_NETWORK = ["--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=http://127.0.0.1:9",
              "--proxy-bypass-list=<-loopback>", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-default-apps", "--no-pings"]
"""Every name resolves to nothing and every http(s) request, loopback included, goes to a refusing proxy
(port 9, discard, has no listener here); Chromium's own background traffic is switched off."""


def find_chromium() -> str | None:
    """The path of the first of :data:`NAMES` on the ``PATH``; None where there is none."""
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    """The browser answered a command with an error, died, or kept silent for :data:`WAIT_S`."""


class Browser:
    """One headless Chromium with a fresh profile; a context manager that kills it on exit.

    ``width`` x ``height``: each tab's viewport in CSS pixels, at one device pixel each (what a screenshot
    holds)."""

    def __init__(self, path: str, *, width: int = 900, height: int = 700) -> None:
        self._profile = tempfile.mkdtemp(prefix="credit-browser-")
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def onto_fds_3_and_4():  # in the child: the protocol's pipes at the numbers Chromium expects
            a, b = os.dup(to_chrome_r), os.dup(from_chrome_w)  # above 4, so neither dup2 overwrites the other
            os.dup2(a, 3)
            os.dup2(b, 4)

        # --no-sandbox: CI containers run as root and lack the user namespaces the sandbox needs; the page
        # is our own file.
        args = [path, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                f"--user-data-dir={self._profile}", "--no-first-run", "--disable-extensions",
                f"--window-size={width},{height}", "--hide-scrollbars", *NO_NETWORK, "about:blank"]
        # pass_fds=(3, 4): open here (the pipes took the lowest free numbers), kept open through the exec
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, preexec_fn=onto_fds_3_and_4, pass_fds=(3, 4))
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._next_id, self.events, self.size = b"", 0, [], (width, height)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=WAIT_S)
        for fd in (self._to_chrome, self._from_chrome):
            os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise BrowserError(f"no message from Chromium in {WAIT_S} s")
            chunk = os.read(self._from_chrome, 1 << 16)
            if not chunk:
                raise BrowserError(f"Chromium closed the protocol pipe (exit code {self._proc.poll()})")
            self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def send(self, method: str, params: dict | None = None, *, session: str | None = None) -> dict:
        """Run one protocol command and return its result; the events that arrive meanwhile go to
        :attr:`events` (``(session id, method, params)``)."""
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + WAIT_S
        while True:
            got = self._read_message(deadline)
            if got.get("id") == self._next_id:
                if "error" in got:
                    raise BrowserError(f"{method}: {got['error']}")
                return got["result"]
            if "method" in got:
                self.events.append((got.get("sessionId"), got["method"], got.get("params", {})))

    def wait_event(self, session: str, method: str) -> dict:
        """The params of the first event ``method`` of ``session`` not yet waited for (from :attr:`events`,
        or the next to arrive)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            for i, (s, m, p) in enumerate(self.events):
                if s == session and m == method:
                    del self.events[i]
                    return p
            got = self._read_message(deadline)
            if "method" in got:
                self.events.append((got.get("sessionId"), got["method"], got.get("params", {})))

    def open(self, url: str) -> "Page":
        """A new tab that has loaded ``url`` (its load event fired) with the network recorded from the
        first request on."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.size[0], "height": self.size[1],
                                                         "deviceScaleFactor": 1, "mobile": False}, session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event(session, "Page.loadEventFired")
        return Page(self, session, target, url)


class Page:
    """One loaded tab of a :class:`Browser`."""

    def __init__(self, browser: Browser, session: str, target: str, url: str) -> None:
        self.browser, self.session, self.target, self.url = browser, session, target, url

    def send(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, session=self.session)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (run by the protocol, not by the page)."""
        got = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in got:
            raise BrowserError(f"{expression!r}: {got['exceptionDetails']}")
        return got["result"].get("value")

    def click(self, selector: str) -> None:
        """A real mouse click (press and release) at the middle of the first element matching ``selector``."""
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box[0], "y": box[1], "button": "left",
                                                   "clickCount": 1})

    def requests(self) -> list[str]:
        """The URL of every request the page sent, its own document's included, so far."""
        self.send("Runtime.evaluate", {"expression": "0"})  # a round trip: earlier events have arrived
        return [p["request"]["url"] for s, m, p in self.browser.events
                if s == self.session and m == "Network.requestWillBeSent"]

    def failures(self) -> dict[str, str]:
        """URL -> Chromium's error text, for each request of the page that failed so far."""
        self.send("Runtime.evaluate", {"expression": "0"})
        mine = [(m, p) for s, m, p in self.browser.events if s == self.session]
        urls = {p["requestId"]: p["request"]["url"] for m, p in mine if m == "Network.requestWillBeSent"}
        return {urls[p["requestId"]]: p["errorText"] for m, p in mine if m == "Network.loadingFailed"}

    def console(self) -> list[str]:
        """Every console call and uncaught exception of the page's own scripts so far, as text."""
        self.send("Runtime.evaluate", {"expression": "0"})
        out = []
        for s, m, p in self.browser.events:
            if s == self.session and m == "Runtime.consoleAPICalled":
                out.append(f"console.{p['type']}: " + " ".join(str(a.get("value")) for a in p["args"]))
            elif s == self.session and m == "Runtime.exceptionThrown":
                out.append(f"exception: {p['exceptionDetails'].get('text')}")
        return out

    def screenshot(self) -> bytes:
        """The visible part of the page as PNG bytes."""
        import base64

        return base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"])

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})
