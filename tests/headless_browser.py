"""Headless Chromium driven over the DevTools protocol, for the dashboard test (``tests/test_dashboard.py``).

``Browser`` starts ``chromium --headless=new`` on a DevTools port of its own (``--remote-debugging-port=0``:
Chromium picks one and writes it to ``DevToolsActivePort`` in its profile folder) and talks to its one
page over a websocket (aiohttp's client: aiohttp comes with ``ray[default]``). It sets cookies, opens
a URL, waits until the rendered text holds what the caller expects, and takes PNG screenshots.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

START_S = 60
CALL_S = 120  # one DevTools command (a page's renderer may wait long for a busy CPU)


def chromium_path() -> str | None:
    """Debian's ``chromium`` (or a ``chromium-browser``/``google-chrome`` on PATH), or None."""
    return next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)


class Browser:
    """One headless Chromium with one page; close it with ``close()`` (or use it as a context manager)."""

    def __init__(self, profile: Path, width: int = 1400, height: int = 900):
        self.profile = profile
        profile.mkdir(parents=True, exist_ok=True)
        self.log = (profile / "chromium.log").open("w")
        self.proc = subprocess.Popen(
            [chromium_path(), "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.loop = asyncio.new_event_loop()
        self._ids = 0
        try:
            self.loop.run_until_complete(self._connect(self._page_socket(), width, height))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the DevTools connection ----------------------------------------------------------------
    def _page_socket(self) -> str:
        """The websocket of the page Chromium opened (about:blank)."""
        port_file = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.proc.returncode}; see {self.log.name}")
            if port_file.is_file() and port_file.read_text().strip():
                port = int(port_file.read_text().split()[0])
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=CALL_S) as answer:
                    pages = [t for t in json.load(answer) if t["type"] == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.2)
        raise RuntimeError(f"chromium opened no DevTools port within {START_S} s; see {self.log.name}")

    async def _connect(self, url: str, width: int, height: int) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession()
        self.socket = await self.session.ws_connect(url, max_msg_size=0)
        await self._call("Emulation.setDeviceMetricsOverride",
                         {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})

    async def _call(self, method: str, params: dict | None = None) -> dict:
        """Send one DevTools command and return its result (events arriving meanwhile are skipped)."""
        self._ids += 1
        await self.socket.send_str(json.dumps({"id": self._ids, "method": method, "params": params or {}}))
        while True:
            message = json.loads((await asyncio.wait_for(self.socket.receive(), CALL_S)).data)
            if message.get("id") == self._ids:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def call(self, method: str, params: dict | None = None) -> dict:
        return self.loop.run_until_complete(self._call(method, params))

    # ---- what the test does ---------------------------------------------------------------------
    def set_cookie(self, url: str, name: str, value: str) -> None:
        """A cookie for ``url``'s site, HttpOnly and SameSite=Strict (as the dashboard itself sets its token)."""
        done = self.call("Network.setCookie", {"url": url, "name": name, "value": value, "httpOnly": True,
                                               "sameSite": "Strict"})
        assert done.get("success", True), done

    def open(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def text(self) -> str:
        """The page's rendered text (``document.body.innerText``)."""
        result = self.call("Runtime.evaluate", {"expression": "document.body ? document.body.innerText : ''",
                                                "returnByValue": True})
        return result["result"].get("value") or ""

    def wait_for_text(self, *needles: str, timeout_s: float = 60) -> str:
        """The rendered text once it holds every needle; AssertionError with the last text when it never does."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            if all(n in text for n in needles) or time.monotonic() > deadline:
                missing = [n for n in needles if n not in text]
                assert not missing, f"not rendered within {timeout_s:g} s: {missing}; page text:\n{text[:3000]}"
                return text
            time.sleep(0.5)

    def wait_for_text_any(self, *needles: str, timeout_s: float = 60) -> str:
        """The rendered text once it holds one of the needles."""
        text = self.poll_text(needles, timeout_s)
        assert any(n in text for n in needles), f"none of {needles} rendered within {timeout_s:g} s:\n{text[:3000]}"
        return text

    def poll_text(self, needles: tuple[str, ...], timeout_s: float) -> str:
        """The rendered text once it holds one of ``needles``, or after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            if any(n in text for n in needles) or time.monotonic() > deadline:
                return text
            time.sleep(0.5)

    def click_text(self, label: str, near: str | None = None) -> bool:
        """Click the first button or link whose text is ``label`` (any case), the first after the text ``near``
        when given; False when there is none."""
        script = f"""(() => {{
            const label = {json.dumps(label.lower())}, near = {json.dumps(near)};
            let after = null;
            if (near) {{
                const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
                while (!after && walker.nextNode())
                    if (walker.currentNode.textContent.includes(near)) after = walker.currentNode;
                if (!after) return false;
            }}
            const target = [...document.querySelectorAll('button, a, [role=button]')].find(e =>
                e.innerText.trim().toLowerCase() === label
                && (!after || after.compareDocumentPosition(e) & Node.DOCUMENT_POSITION_FOLLOWING));
            if (target) target.click();
            return !!target;
        }})()"""
        return bool(self.call("Runtime.evaluate", {"expression": script, "returnByValue": True})["result"].get("value"))

    def screenshot(self, path: Path) -> Path:
        """A PNG of the viewport."""
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.loop.run_until_complete(self.socket.close())
        if getattr(self, "session", None) is not None:
            self.loop.run_until_complete(self.session.close())
        self.loop.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:  # its helper processes (zygote, renderers) are in the session it started
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
