"""A real headless browser for tests: Chromium driven over the DevTools protocol (CDP).

No driver binary and no browser download: Debian's ``chromium`` (installed by
``ops/bootstrap``) started with ``--remote-debugging-port=0``, and its WebSocket spoken with
trio-websocket, which shard already depends on. Input is real input (``Input.insertText``,
key events), so the page's own handlers run as they would for a person. A missing browser
fails the test loudly; it is never skipped.
"""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
from contextlib import AsyncExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_path() -> str:
    """The browser to test with. Errors: fails the test (loudly) when there is none."""
    for name in _NAMES:
        if (path := shutil.which(name)) is not None:
            return path
    pytest.fail(
        "NO BROWSER: the chat page test needs Chromium; install it with "
        "`apt-get install -y chromium` (ops/bootstrap does this) and run again",
        pytrace=False,
    )


class CdpError(Exception):
    """The browser answered a command with an error, or the page threw."""


class Browser:
    """One headless Chromium process and its DevTools connection (``async with``)."""

    def __init__(self, path: str, tmp: Path) -> None:
        self._path = path
        self._tmp = tmp
        self._stack = AsyncExitStack()
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._events: list[tuple[str, trio.MemorySendChannel[dict[str, Any]]]] = []
        self._proc: trio.Process | None = None
        self._ws: WebSocketConnection | None = None

    async def __aenter__(self) -> Browser:
        args = [
            self._path,
            "--headless",
            "--no-sandbox",  # tests run as root in a container
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            f"--user-data-dir={self._tmp / 'chromium-profile'}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        self._proc = await trio.lowlevel.open_process(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        self._stack.push_async_callback(self._kill)
        with trio.fail_after(30):
            url = await self._devtools_url()
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        self._stack.callback(nursery.cancel_scope.cancel)
        self._ws = await self._stack.enter_async_context(
            open_websocket_url(url, max_message_size=64 << 20)
        )
        nursery.start_soon(self._read)
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.aclose()

    async def _devtools_url(self) -> str:
        assert self._proc is not None and self._proc.stderr is not None
        buffer = b""
        async for chunk in self._proc.stderr:
            buffer += chunk
            for line in buffer.decode(errors="replace").splitlines():
                if line.startswith("DevTools listening on "):
                    return line.removeprefix("DevTools listening on ").strip()
        raise CdpError(f"chromium exited before it listened: {buffer.decode()[-2000:]}")

    async def _kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                await self._proc.wait()

    async def _read(self) -> None:
        assert self._ws is not None
        while True:
            try:
                msg = json.loads(await self._ws.get_message())
            except ConnectionClosed:
                return  # closing on the way out
            if "id" in msg and msg["id"] in self._waiting:
                self._waiting.pop(msg["id"]).send_nowait(msg)
            elif "method" in msg:
                for method, channel in list(self._events):
                    if method == msg["method"]:
                        self._events.remove((method, channel))
                        channel.send_nowait(msg)

    async def call(self, method: str, session: str | None = None, **params: Any) -> Any:
        """Send one CDP command and return its result. Errors: ``CdpError``."""
        assert self._ws is not None
        ident = next(self._ids)
        send, recv = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[ident] = send
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session is not None:
            message["sessionId"] = session
        await self._ws.send_message(json.dumps(message))
        with trio.fail_after(60):
            reply = await recv.receive()
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def expect(self, method: str) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """A channel that gets the next ``method`` event (subscribe before causing it)."""
        send, recv = trio.open_memory_channel[dict[str, Any]](1)
        self._events.append((method, send))
        return recv

    async def open(self, url: str) -> Page:
        """A new tab showing ``url`` once its load event fired."""
        target = await self.call("Target.createTarget", url="about:blank")
        attached = await self.call(
            "Target.attachToTarget", targetId=target["targetId"], flatten=True
        )
        page = Page(self, attached["sessionId"])
        await self.call("Page.enable", page.session)
        await page.navigate(url)
        return page


class Page:
    """One tab: navigate, evaluate JavaScript, click, type and press keys."""

    def __init__(self, browser: Browser, session: str) -> None:
        self._browser = browser
        self.session = session

    async def navigate(self, url: str) -> None:
        loaded = self._browser.expect("Page.loadEventFired")
        await self._browser.call("Page.navigate", self.session, url=url)
        with trio.fail_after(30):
            await loaded.receive()

    async def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        """The value of ``expression`` in the page (awaited when it is a promise)."""
        result = await self._browser.call(
            "Runtime.evaluate",
            self.session,
            expression=expression,
            awaitPromise=await_promise,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            raise CdpError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, condition: str, *, timeout_ms: int = 30_000) -> None:
        """Until ``condition`` (JavaScript) holds, checked by the page on each frame."""
        await self.evaluate(
            "new Promise((ok, fail) => { const end = performance.now() + "
            f"{timeout_ms}; const check = () => ({condition}) ? ok(true) : "
            "performance.now() > end ? fail(new Error('timed out')) : "
            "requestAnimationFrame(check); check(); })",
            await_promise=True,
        )

    async def click(self, selector: str) -> None:
        """A real mouse click at the middle of the element ``selector``."""
        box = await self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            await self._browser.call(
                "Input.dispatchMouseEvent",
                self.session,
                type=kind,
                x=box[0],
                y=box[1],
                button="left",
                clickCount=1,
            )

    async def type_text(self, text: str) -> None:
        await self._browser.call("Input.insertText", self.session, text=text)

    async def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            await self._browser.call(
                "Input.dispatchKeyEvent",
                self.session,
                type=kind,
                key="Enter",
                code="Enter",
                windowsVirtualKeyCode=13,
                text="\r" if kind == "keyDown" else "",
            )
