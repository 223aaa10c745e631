"""Headless Chromium for tests: load a page, collect its errors, DOM and a screenshot.

Talks the Chrome DevTools protocol over a pipe (`--remote-debugging-pipe`),
so it needs nothing beyond the standard library and Debian's `chromium`,
and tells a `console.error` apart from a `console.log`.

Usage in a test:

    from browser import load_page

    @pytest.mark.browser
    def test_page(tmp_path):
        page = load_page(
            tmp_path / "report.html",
            wait_for="document.querySelector('.main-svg')",
            evaluate={"plots": "document.querySelectorAll('.main-svg').length"},
            screenshot="report.png",
        )
        assert page.errors == []
        assert page.values["plots"] > 0

`load_page` skips the test (with the reason) when Chromium is missing, unless
the environment sets MPPROF_REQUIRE_BROWSER=1 (as CI does): then it fails.
Screenshots are saved under test-artifacts/ at the repository root.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pathlib
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import pytest

ARTIFACTS = pathlib.Path(__file__).resolve().parent.parent / "test-artifacts"
_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
    "--window-size=1400,1000",
)


@dataclasses.dataclass
class PageLoad:
    """What a page did while it loaded.

    Attributes:
        url: the URL loaded.
        dom: `document.documentElement.outerHTML` after loading.
        errors: uncaught exceptions, `console.error`/`console.assert` calls and
            browser log errors (failed requests, CSP violations), as text.
        console: every console message, as "level: text".
        values: the results of the `evaluate` expressions, by name.
        screenshot: where the screenshot was saved, or None.
    """

    url: str
    dom: str
    errors: list[str]
    console: list[str]
    values: dict
    screenshot: pathlib.Path | None


_SERVING = re.compile(r"TensorBoard \S+ at (http://127\.0\.0\.1:\d+/)")


@contextlib.contextmanager
def serve_tensorboard(logdir=None, flags: tuple[str, ...] = ()) -> Iterator[str]:
    """`tensorboard --logdir LOGDIR` (or with `flags` instead, e.g.
    `("--logdir_spec", "a:DIR1,b:DIR2")`) on 127.0.0.1 and a free port, with
    the installed plugin; yields its base URL and stops it on exit."""
    tensorboard = pathlib.Path(sys.executable).with_name("tensorboard")
    where = ["--logdir", str(logdir)] if logdir is not None else list(flags)
    process = subprocess.Popen(
        [str(tensorboard), *where, "--port", "0", "--host", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found = threading.Event()
    lines: list[str] = []
    url: list[str] = []

    def read_stderr():
        for line in process.stderr:
            lines.append(line)
            match = _SERVING.search(line)
            if match and not url:
                url.append(match.group(1))
                found.set()

    threading.Thread(target=read_stderr, daemon=True).start()
    try:
        if not found.wait(timeout=120):
            pytest.fail("tensorboard did not start:\n" + "".join(lines[-30:]))
        yield url[0]
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def chromium_path() -> str | None:
    """The Chromium executable, from $CHROMIUM or the PATH, or None."""
    explicit = os.environ.get("CHROMIUM")
    if explicit:
        return explicit if shutil.which(explicit) else None
    return next(
        (shutil.which(name) for name in _CANDIDATES if shutil.which(name)), None
    )


def require_chromium() -> str:
    """The Chromium executable; skips the test without one (fails in CI)."""
    path = chromium_path()
    if path is None:
        reason = (
            "headless Chromium not found (install Debian's `chromium` package, or "
            "set CHROMIUM=/path/to/chrome)"
        )
        if os.environ.get("MPPROF_REQUIRE_BROWSER") == "1":
            pytest.fail(f"MPPROF_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    return path


def load_page(
    target: str | os.PathLike,
    *,
    wait_for: str | None = None,
    evaluate: dict[str, str | Callable[[], object]] | None = None,
    screenshot: str | None = None,
    timeout: float = 60.0,
    settle: float = 0.3,
    color_scheme: str | None = None,
    blocked_urls: tuple[str, ...] = (),
) -> PageLoad:
    """Loads `target` (a URL or a local file) in headless Chromium.

    Args:
        target: an http(s)/file URL, or a path to a local file.
        wait_for: a JavaScript expression; after the load event, waits until
            it is truthy (fails the test if it never is within `timeout`).
        evaluate: JavaScript expressions evaluated after loading, by name;
            their (JSON) values land in `PageLoad.values`. A Python callable
            in their place is called at its turn (e.g. to change what the
            server serves between two expressions); its result lands there too.
        screenshot: file name of a PNG screenshot to save in test-artifacts/.
        timeout: seconds before giving up on the page.
        settle: seconds to wait after loading so late errors are caught.
        color_scheme: "dark" or "light": the `prefers-color-scheme` the page
            sees (None: the browser's default, light).
        blocked_urls: URL patterns ("*" wildcards) the page may not load, as
            if the network failed them.
    """
    executable = require_chromium()
    url = _as_url(target)
    with tempfile.TemporaryDirectory(prefix="mpprof-chromium-") as profile:
        with _DevTools(executable, profile) as devtools:
            return devtools.load(
                url,
                wait_for,
                evaluate or {},
                screenshot,
                timeout,
                settle,
                color_scheme,
                blocked_urls,
            )


def _as_url(target) -> str:
    text = os.fspath(target)
    if "://" in text or text.startswith(("about:", "data:")):
        return text
    return pathlib.Path(text).resolve().as_uri()


class _DevTools:
    """A Chromium process driven over the DevTools pipe (fds 3 and 4)."""

    def __init__(self, executable: str, profile: str):
        self._executable = executable
        self._profile = profile
        self._next_id = 0
        self._messages: queue.Queue = queue.Queue()
        self._events: list[dict] = []

    def __enter__(self):
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()

        # Chromium reads commands from fd 3 and writes replies to fd 4.
        def wire_pipes():
            os.dup2(to_browser_read, 3)
            os.dup2(from_browser_write, 4)

        self._process = subprocess.Popen(
            [
                self._executable,
                *_FLAGS,
                f"--user-data-dir={self._profile}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Keep 3 and 4 open: the child closes every fd not listed here
            # after `wire_pipes` ran.
            pass_fds=(3, 4),
            preexec_fn=wire_pipes,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        threading.Thread(target=self._read_messages, daemon=True).start()
        return self

    def __exit__(self, *exc_info):
        try:
            self._send("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)

    def load(
        self,
        url,
        wait_for,
        evaluate,
        screenshot,
        timeout,
        settle,
        color_scheme=None,
        blocked_urls=(),
    ) -> PageLoad:
        deadline = time.monotonic() + timeout
        target = self._send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self._send(
            "Target.attachToTarget", {"targetId": target, "flatten": True}
        )["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            self._send(f"{domain}.enable", session=session)
        if blocked_urls:
            self._send("Network.enable", session=session)
            self._send(
                "Network.setBlockedURLs", {"urls": list(blocked_urls)}, session=session
            )
        if color_scheme:
            features = [{"name": "prefers-color-scheme", "value": color_scheme}]
            self._send("Emulation.setEmulatedMedia", {"features": features}, session=session)
        self._send("Page.navigate", {"url": url}, session=session)
        self._wait_event("Page.loadEventFired", deadline)
        if wait_for:
            while not self._evaluate(f"Boolean({wait_for})", session):
                if time.monotonic() > deadline:
                    pytest.fail(f"{url}: `{wait_for}` still false after {timeout} s")
                time.sleep(0.1)
        time.sleep(settle)
        values = {
            name: expr() if callable(expr) else self._evaluate(expr, session)
            for name, expr in evaluate.items()
        }
        dom = self._evaluate("document.documentElement.outerHTML", session)
        saved = None
        if screenshot:
            height = self._evaluate("document.documentElement.scrollHeight", session)
            data = self._send(
                "Page.captureScreenshot", _full_page(height), session=session
            )
            ARTIFACTS.mkdir(exist_ok=True)
            saved = ARTIFACTS / screenshot
            saved.write_bytes(base64.b64decode(data["data"]))
        self._drain()
        errors, console = _errors_and_console(self._events)
        return PageLoad(url, dom, errors, console, values, saved)

    def _on_event(self, event: dict) -> None:
        self._events.append(event)
        if event.get("method") == "Page.javascriptDialogOpening":
            # alert()/confirm() block the page until answered; answer without
            # waiting (the reply is just another message). It counts as an error.
            self._next_id += 1
            command = {
                "id": self._next_id,
                "method": "Page.handleJavaScriptDialog",
                "params": {"accept": False},
                "sessionId": event.get("sessionId"),
            }
            os.write(self._to_browser, json.dumps(command).encode() + b"\0")

    def _evaluate(self, expression: str, session: str):
        reply = self._send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=session,
        )
        if "exceptionDetails" in reply:
            pytest.fail(
                f"evaluating `{expression}` raised: {reply['exceptionDetails']}"
            )
        return reply["result"].get("value")

    def _send(self, method, params=None, *, session=None, timeout=60.0) -> dict:
        self._next_id += 1
        message_id = self._next_id
        message = {"id": message_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next_message(deadline, method)
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method} failed: {reply['error']}")
                return reply.get("result", {})
            self._on_event(reply)

    def _wait_event(self, method: str, deadline: float) -> None:
        if any(e.get("method") == method for e in self._events):
            return
        while True:
            event = self._next_message(deadline, method)
            self._on_event(event)
            if event.get("method") == method:
                return

    def _next_message(self, deadline: float, waiting_for: str) -> dict:
        remaining = deadline - time.monotonic()
        try:
            message = self._messages.get(timeout=max(remaining, 0.01))
        except queue.Empty:
            pytest.fail(f"headless Chromium: no {waiting_for} in time")
        if message is None:
            pytest.fail(f"headless Chromium exited while waiting for {waiting_for}")
        return message

    def _drain(self) -> None:
        while True:
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return
            if message is not None:
                self._on_event(message)

    def _read_messages(self) -> None:
        buffer = b""
        with os.fdopen(self._from_browser, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                buffer += chunk
                *complete, buffer = buffer.split(b"\0")
                for raw in complete:
                    self._messages.put(json.loads(raw))
        self._messages.put(None)


def _full_page(height, max_height: int = 12_000) -> dict:
    """Screenshot parameters for the whole page (capped), not just the window."""
    height = min(int(height or 1000), max_height)
    return {
        "format": "png",
        "captureBeyondViewport": True,
        "clip": {"x": 0, "y": 0, "width": 1400, "height": height, "scale": 1},
    }


def _errors_and_console(events: list[dict]) -> tuple[list[str], list[str]]:
    errors, console = [], []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(
                str(arg.get("value", arg.get("description", "")))
                for arg in params["args"]
            )
            console.append(f"{params['type']}: {text}")
            if params["type"] in ("error", "assert"):
                errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            description = details.get("exception", {}).get(
                "description"
            ) or details.get("text")
            errors.append(f"uncaught: {description}")
        elif method == "Page.javascriptDialogOpening":
            errors.append(f"dialog: {params.get('type')} {params.get('message')!r}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            entry = params["entry"]
            errors.append(
                f"{entry['source']}: {entry['text']} {entry.get('url', '')}".strip()
            )
    return errors, console
