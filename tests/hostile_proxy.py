"""A test double for a hostile speech server: an HTTP proxy in front of a real engine (the CPU test
engine) that answers every speech request with audio it changed, the way a broken server could,
and passes everything else through. Not an engine: what it changes is the upstream's answer.

modes: `pass` (the upstream's answers unchanged), `silence` (digital silence as long as the right answer), `same` (the first answer, for every
request), `late` (the right audio one sample late), `pcm8` (the right audio as 8-bit PCM),
`serial` (the right audio, one request at a time: the engine never batches two). The upstream's
headers pass through (the CPU engine's batch size among them). `upstream` may be changed while it
runs (a build redeployed behind the same URL), and `version` set answers GET /version itself.
"""

from __future__ import annotations

import io
import json
import threading
import urllib.request
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from difftest.suites import wavio

MODES = ("pass", "silence", "same", "late", "pcm8", "serial")


def _pcm8(wav: bytes) -> bytes:
    audio, info = wavio.read(wav)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(1)
        w.setframerate(info.sample_rate)
        w.writeframes((np.clip(audio, -1, 1) * 127 + 128).astype(np.uint8).tobytes())
    return buf.getvalue()


class HostileProxy:
    def __init__(self, upstream: str, mode: str):
        assert mode in MODES, mode
        self.upstream, self.mode = upstream.rstrip("/"), mode
        self.first: bytes | None = None
        self.version: dict | None = None  # what GET /version answers, when set (else the upstream's)
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _forward(self, body: bytes | None):
                # serial: no wave hint either (the engine would hold the first request for a wave-mate this
                # proxy lets through only after it, and then run it alone after the 30 s guard)
                drop = ("host", "content-length") + (("x-difftest-wave",) if outer.mode == "serial" else ())
                req = urllib.request.Request(outer.upstream + self.path, data=body, method=self.command,
                                             headers={k: v for k, v in self.headers.items() if k.lower() not in drop})
                try:
                    with urllib.request.urlopen(req, timeout=600) as r:
                        return r.status, dict(r.headers), r.read()
                except urllib.error.HTTPError as e:
                    return e.code, dict(e.headers), e.read()

            def _send(self, status, headers, body):  # the upstream's headers pass through
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/version" and outer.version is not None:
                    return self._send(200, {"Content-Type": "application/json"}, json.dumps(outer.version).encode())
                self._send(*self._forward(None))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if not self.path.startswith("/v1/audio/speech"):
                    return self._send(*self._forward(body))
                if outer.mode == "pass":
                    return self._send(*self._forward(body))
                if outer.mode == "serial":
                    with outer.lock:
                        return self._send(*self._forward(body))
                status, headers, answer = self._forward(body)
                if status == 200:
                    answer = outer.change(answer)
                self._send(status, headers, answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def change(self, answer: bytes) -> bytes:
        audio, info = wavio.read(answer)
        if self.mode == "silence":
            return wavio.encode(np.zeros(len(audio), np.float32), info.sample_rate)
        if self.mode == "same":
            with self.lock:
                self.first = self.first or answer
            return self.first
        if self.mode == "late":
            return wavio.encode(np.concatenate([[0.0], audio[:-1]]).astype(np.float32), info.sample_rate)
        return _pcm8(answer)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
