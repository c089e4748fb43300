"""Drive a headless Chromium over the DevTools protocol on 127.0.0.1 (no extra dependency:
the websocket client is tornado's, which Jupyter already installs).

Used by the viewer's browser test and by ``python -m evals.bench_view``::

    with Chromium() as browser:
        browser.open("file:///tmp/view.html", ready="document.body.dataset.ready === '1'")
        n = browser.eval("document.querySelectorAll('.row').length")
        browser.screenshot("view.png")

The browser runs with its own throw-away profile, no sandbox (containers), no GPU, and
background networking, component updates and first-run tasks off, so it talks to nothing but
the loopback DevTools socket.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["find_chromium", "Chromium", "ChromiumError"]

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


class ChromiumError(RuntimeError):
    """The browser could not be started, or a DevTools command failed."""


def find_chromium() -> str | None:
    """The browser binary: ``$RLM_CHROMIUM``, else the first of chromium/chrome on PATH."""
    env = os.environ.get("RLM_CHROMIUM")
    if env:
        return env if Path(env).exists() else shutil.which(env)
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """One headless browser with one page, driven over DevTools.

    Args:
        binary: the browser (default :func:`find_chromium`).
        width, height: the page's viewport in CSS pixels.
        timeout: seconds to wait for the browser to start and for each command.
    """

    def __init__(self, binary: str | None = None, *, width: int = 1400, height: int = 900,
                 timeout: float = 30.0) -> None:
        self.binary = binary or find_chromium()
        if not self.binary:
            raise ChromiumError("no Chromium found (install the Debian package `chromium`)")
        self.width, self.height, self.timeout = width, height, timeout
        self._profile = tempfile.mkdtemp(prefix="rlm-chromium-")
        self._loop = asyncio.new_event_loop()
        self._proc: subprocess.Popen | None = None
        self._ws = None
        self._session: str | None = None
        self._next = 0
        self.console_errors: list[str] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Chromium":
        args = [self.binary, "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--no-first-run", "--no-default-browser-check", "--disable-dev-shm-usage",
                "--disable-extensions", "--disable-sync", "--metrics-recording-only",
                "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}",
                "about:blank"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        port_file = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while True:
            if port_file.exists():
                lines = port_file.read_text().split()
                if len(lines) >= 2:
                    break
            if self._proc.poll() is not None:
                raise ChromiumError(f"{self.binary} exited with {self._proc.returncode}")
            if time.monotonic() > deadline:
                self.close()
                raise ChromiumError(f"{self.binary} did not open its DevTools port")
            time.sleep(0.02)
        url = f"ws://127.0.0.1:{lines[0]}{lines[1]}"
        self._ws = self._run(self._connect(url))
        target = self._call("Target.createTarget", {"url": "about:blank"}, session=False)
        att = self._call("Target.attachToTarget", {"targetId": target["targetId"],
                                                   "flatten": True}, session=False)
        self._session = att["sessionId"]
        self._call("Runtime.enable")
        self._call("Page.enable")
        self._call("Emulation.setDeviceMetricsOverride",
                   {"width": self.width, "height": self.height, "deviceScaleFactor": 1,
                    "mobile": False})
        return self

    def close(self) -> None:
        """Stop the browser (its whole process group) and remove its profile. Idempotent."""
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:
                pass
            self._ws = None
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.killpg(self._proc.pid, 15)
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self._proc.pid, 9)
                except OSError:
                    pass
                self._proc.wait(timeout=5)
        self._proc = None
        shutil.rmtree(self._profile, ignore_errors=True)
        if not self._loop.is_closed():
            self._loop.close()

    def __enter__(self) -> "Chromium":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ protocol
    def _run(self, coro):
        return self._loop.run_until_complete(asyncio.wait_for(coro, self.timeout))

    async def _connect(self, url: str):
        from tornado.websocket import websocket_connect
        return await websocket_connect(url, max_message_size=512 * 1024 * 1024)

    async def _roundtrip(self, msg: dict) -> dict:
        await self._ws.write_message(json.dumps(msg))
        while True:
            raw = await self._ws.read_message()
            if raw is None:
                raise ChromiumError("the browser closed the DevTools connection")
            reply = json.loads(raw)
            if reply.get("method") == "Runtime.exceptionThrown":
                d = reply["params"]["exceptionDetails"]
                self.console_errors.append(str((d.get("exception") or {}).get("description")
                                               or d.get("text")))
            if reply.get("id") == msg["id"]:
                return reply

    def _call(self, method: str, params: dict | None = None, *, session: bool = True) -> dict:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session and self._session:
            msg["sessionId"] = self._session
        reply = self._run(self._roundtrip(msg))
        if "error" in reply:
            raise ChromiumError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    # ------------------------------------------------------------------ page helpers
    def eval(self, expression: str) -> Any:
        """Evaluate JavaScript in the page and return its (JSON) value."""
        res = self._call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                              "awaitPromise": True})
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            raise ChromiumError(f"page error: {(d.get('exception') or {}).get('description') or d}")
        return res.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout: float | None = None, poll: float = 0.01) -> Any:
        """Poll ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            try:
                value = self.eval(expression)
            except ChromiumError:
                value = None  # the page is still loading
            if value:
                return value
            if time.monotonic() > deadline:
                raise ChromiumError(f"timed out waiting for {expression!r}")
            time.sleep(poll)

    def open(self, url: str, ready: str | None = None, timeout: float | None = None) -> None:
        """Navigate and, with ``ready``, wait until that expression is truthy."""
        self._call("Page.navigate", {"url": url})
        if ready:
            self.wait_for(f"(() => {{ try {{ return {ready}; }} catch (e) {{ return false; }} }})()",
                          timeout)

    def click(self, selector: str) -> None:
        """Click the first element matching ``selector`` (a real DOM click event)."""
        ok = self.eval(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                       f"if (!e) return false; e.click(); return true; }})()")
        if not ok:
            raise ChromiumError(f"nothing matches {selector!r}")

    def screenshot(self, path: str | os.PathLike, *, full_page: bool = False) -> Path:
        """Save a PNG of the viewport (or the whole page) to ``path``."""
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            size = self.eval("[document.documentElement.scrollWidth, "
                             "document.documentElement.scrollHeight]")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1})
        data = self._call("Page.captureScreenshot", params)["data"]
        p = Path(path)
        p.write_bytes(base64.b64decode(data))
        return p
