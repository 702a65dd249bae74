"""Headless Chromium over the DevTools protocol, stdlib only: how the tests (and a person who
wants a picture of a site) look at a built dashboard after the browser has laid it out.

    with Chromium() as browser:
        page = browser.open(Path("SITE/index.html").resolve().as_uri())
        page.evaluate("document.title")
        page.screenshot(Path("index.png"))

The protocol runs over `--remote-debugging-pipe` (Chromium reads commands on fd 3 and
writes answers on fd 4, each message a JSON text ended by a NUL byte), so no port, no
websocket library and no browser download are needed: Debian's `chromium` package is
enough (`apt-get install -y chromium`).

    python -m dashboards.browser SITE/index.html shot.png [--width 1400]
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
# As root in a container: no sandbox; no GPU; nothing that talks to the network on its own.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
         "--remote-debugging-pipe")

TRAMPOLINE = ("import os, sys; r, w = int(sys.argv[1]), int(sys.argv[2]); os.dup2(r, 3); os.dup2(w, 4); "
              "os.close(r); os.close(w); os.execv(sys.argv[3], sys.argv[3:])")


# How long one answer or event may take. Every wait ends as soon as what it waits for happens; the bound
# only ends a wait on a browser that will never answer, so it is minutes: a loaded machine is slow, not dead.
TIMEOUT_S = 300.0


class BrowserError(RuntimeError):
    pass


class BrowserTimeout(BrowserError):
    """No answer (or event) within the bound."""


def find_chromium(explicit: str | None = None) -> str | None:
    """$CHROMIUM, else the first Chromium or Chrome on PATH (Debian: /usr/bin/chromium)."""
    if explicit:
        return explicit
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    for name in CANDIDATES:
        if path := shutil.which(name):
            return path
    return None


class Chromium:
    """One headless Chromium process; a context manager. Its profile is a new empty folder,
    removed on the way out; its stderr goes to `log` (default: the profile folder, kept in
    the error message when something fails)."""

    def __init__(self, executable: str | None = None, *, width: int = 1400, height: int = 900,
                 timeout_s: float = TIMEOUT_S, log: Path | None = None, extra_flags=()):
        self.executable = find_chromium(executable)
        if self.executable is None:
            raise BrowserError("no Chromium found: apt-get install -y chromium (or set $CHROMIUM)")
        self.width, self.height, self.timeout_s = width, height, timeout_s
        self.extra_flags = tuple(extra_flags)
        self.log_path = log
        self._profile: str | None = None
        self._proc: subprocess.Popen | None = None
        self._next_id = 0
        self._lock = threading.Lock()
        self._answers: dict[int, queue.Queue] = {}
        self._events: queue.Queue = queue.Queue()
        self._closed = threading.Event()

    # -- process -----------------------------------------------------------------------------------
    def __enter__(self) -> "Chromium":
        self._profile = tempfile.mkdtemp(prefix="difftest-chromium-")
        r, self._to_browser = os.pipe()
        self._from_browser, w = os.pipe()
        # Above fd 10, so that moving them to 3 and 4 in the child never overwrites one of them.
        to_browser_r, from_browser_w = fcntl.fcntl(r, fcntl.F_DUPFD, 10), fcntl.fcntl(w, fcntl.F_DUPFD, 10)
        os.close(r)
        os.close(w)
        log_path = self.log_path or Path(self._profile) / "chromium.log"
        self.log_path = Path(log_path)
        args = [*FLAGS, f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}",
                *self.extra_flags, "about:blank"]
        # A small Python trampoline puts the two pipe ends where Chromium looks for them (fds 3
        # and 4) and execs it: no preexec_fn (unsafe when this process has threads), and no shell
        # (dash redirects only fds 0-9).
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen([sys.executable, "-c", TRAMPOLINE, str(to_browser_r), str(from_browser_w),
                                           self.executable, *args],
                                          pass_fds=(to_browser_r, from_browser_w), stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        threading.Thread(target=self._reader, name="chromium-devtools", daemon=True).start()
        try:
            self.send("Browser.getVersion")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None and not self._closed.is_set():
                    self._write({"id": self._take_id(), "method": "Browser.close"})
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, 9)
                except ProcessLookupError:
                    pass
                proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        if self._profile:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    # -- the protocol --------------------------------------------------------------------------------
    def _reader(self) -> None:
        buf = b""
        while True:
            try:
                data = os.read(self._from_browser, 1 << 16)
            except OSError:
                data = b""
            if not data:
                self._closed.set()
                for q in list(self._answers.values()):
                    q.put(None)
                self._events.put(None)
                return
            buf += data
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg and msg["id"] in self._answers:
                    self._answers[msg["id"]].put(msg)
                elif "method" in msg:
                    self._events.put(msg)

    def _take_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def _write(self, msg: dict) -> None:
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float | None = None) -> dict:
        """A command's result; BrowserError on a protocol error, a timeout or a dead browser."""
        mid = self._take_id()
        q: queue.Queue = queue.Queue()
        self._answers[mid] = q
        msg = {"id": mid, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        try:
            self._write(msg)
            answer = q.get(timeout=timeout_s or self.timeout_s)
        except queue.Empty:
            raise BrowserTimeout(f"{method}: no answer in {timeout_s or self.timeout_s:.0f} s") from None
        except OSError as e:
            raise BrowserError(f"{method}: Chromium is gone ({e}); its log ends:\n{self._log_tail()}") from None
        finally:
            self._answers.pop(mid, None)
        if answer is None:
            raise BrowserError(f"{method}: Chromium exited; its log ends:\n{self._log_tail()}")
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error'].get('message')} {answer['error'].get('data', '')}")
        return answer.get("result", {})

    def events(self, timeout_s: float):
        """Events as they come, until timeout_s passes without one or the browser exits."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                ev = self._events.get(timeout=left)
            except queue.Empty:
                return
            if ev is None:
                return
            yield ev

    def open(self, url: str) -> "Page":
        """A new tab on `url`, loaded (the load event fired)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        for domain in ("Page", "Runtime", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False}, session=session)
        page.goto(url)
        return page


class Page:
    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session
        self.network: list[dict] = []  # Network.* events of this tab: what was requested and loaded
        self.console: list[dict] = []  # Runtime.consoleAPICalled and exceptions

    def send(self, method: str, params: dict | None = None, timeout_s: float | None = None) -> dict:
        return self.browser.send(method, params, self.session, timeout_s)

    def _drain(self, until=None, timeout_s: float = TIMEOUT_S) -> bool:
        """Record this tab's events; True when `until(event)` held for one before timeout_s."""
        for ev in self.browser.events(timeout_s):
            if ev.get("sessionId") != self.session:
                continue
            m = ev["method"]
            if m.startswith("Network."):
                self.network.append(ev)
            elif m in ("Runtime.consoleAPICalled", "Runtime.exceptionThrown"):
                self.console.append(ev)
            if until is not None and until(ev):
                return True
        return False

    def goto(self, url: str, timeout_s: float = TIMEOUT_S) -> None:
        self.network.clear()
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"{url}: {result['errorText']}")
        if not self._drain(lambda ev: ev["method"] == "Page.loadEventFired", timeout_s):
            raise BrowserTimeout(f"{url}: no load event in {timeout_s:.0f} s")

    def front(self) -> None:
        """Make this the visible tab. Headless Chromium hides a tab once another one opens (within a
        second or so, later on a busy machine), and then draws no frame for it: a screenshot of a hidden
        tab never answers, and its media may wait to load."""
        self.send("Page.bringToFront")

    def evaluate(self, expression: str, timeout_s: float = TIMEOUT_S):
        """The expression's value (awaited when it is a promise), as JSON."""
        r = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True,
                                           "timeout": int(timeout_s * 1000)}, timeout_s=timeout_s + 5)
        self._drain(timeout_s=0.05)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise BrowserError(f"evaluate: {d.get('exception', {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    def loaded_urls(self, expect=(), timeout_s: float = TIMEOUT_S) -> dict[str, int]:
        """url -> HTTP-like status for every response this tab received (file:// included), once those
        in `expect` are among them (or timeout_s passed: the caller sees which are missing)."""
        def got():
            return {ev["params"]["response"]["url"]: ev["params"]["response"].get("status", 0)
                    for ev in self.network if ev["method"] == "Network.responseReceived"}

        def arrived(ev) -> bool:
            if ev["method"] == "Network.responseReceived":
                missing.discard(ev["params"]["response"]["url"])
            return not missing

        self._drain(timeout_s=0.05)
        missing = set(expect) - set(got())
        if missing:
            self._drain(arrived, timeout_s)
        return got()

    def screenshot(self, path: Path, full_page: bool = True) -> Path:
        """A PNG of the viewport, or of the whole page (the viewport stretched to the content). The tab
        is brought to the front first (front()); a capture that still gets no answer is tried once more."""
        b = self.browser
        self.front()
        if full_page:
            m = self.send("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m["contentSize"]
            height = max(b.height, min(int(size["height"]) + 1, 16000))
            self.send("Emulation.setDeviceMetricsOverride", {"width": b.width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": False})
        try:
            try:
                data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
            except BrowserTimeout:
                self.front()
                data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        finally:
            if full_page:
                self.send("Emulation.setDeviceMetricsOverride", {"width": b.width, "height": b.height,
                                                                 "deviceScaleFactor": 1, "mobile": False})
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path


AUDIO_STATE_JS = """(async () => {
  const one = a => new Promise(resolve => {
    const done = () => resolve({src: a.getAttribute('src'), url: a.currentSrc, duration: a.duration,
                                error: a.error ? a.error.code : null, ready: a.readyState});
    if (a.readyState >= 1 || a.error) return done();
    a.addEventListener('loadedmetadata', done, {once: true});
    a.addEventListener('error', done, {once: true});
    setTimeout(done, %d);
    a.preload = 'metadata';  // the pages say preload="none" (nothing loads until played): ask for it
    a.load();
  });
  return Promise.all([...document.querySelectorAll('audio')].map(one));
})()"""


def audio_state(page: Page, timeout_ms: int = int(TIMEOUT_S * 1000)) -> list[dict]:
    """Every <audio> on the page once its metadata loaded (or it failed): src, duration, error. Each
    is asked to load (the pages load audio only when played) and waits for its loadedmetadata or
    error event; timeout_ms only bounds a load that never ends."""
    page.front()
    return page.evaluate(AUDIO_STATE_JS % timeout_ms, timeout_s=timeout_ms / 1000 + 30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dashboards.browser",
                                 description="a full-page screenshot of an HTML file in headless Chromium")
    ap.add_argument("html")
    ap.add_argument("png")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--chromium", help="the browser executable (default: $CHROMIUM, else chromium on PATH)")
    args = ap.parse_args(argv)
    try:
        with Chromium(args.chromium, width=args.width) as browser:
            page = browser.open(Path(args.html).resolve().as_uri())
            page.screenshot(Path(args.png))
    except BrowserError as e:
        print(f"difftest: error: {e}", file=sys.stderr)
        return 3
    print(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
