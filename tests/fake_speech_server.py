"""A test double for a speech server: the HTTP surface of vLLM-Omni's speech API with toy audio
(tests/toy.py), for testing the HTTP runner's mechanics (patterns, errors, capture pickup) without
an engine. It records every request's arrival. Not an engine: the CPU engine in runners/ is."""

from __future__ import annotations

import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
from toy import toy_codes, toy_decode

from difftest.suites import wavio


class FakeSpeechServer:
    def __init__(self, capture_dir: Path | None = None, delay: float = 0.05, gather: int = 0, prefix: str = ""):
        self.capture_dir = capture_dir
        self.prefix = prefix  # served under this path (a server behind a reverse proxy); elsewhere 404
        self.delay = delay
        # gather=k: each group of k requests (in arrival order) is answered only once all k are in (or
        # after a 120 s guard), so "k in flight at once" does not depend on how fast the machine is
        self.gather = gather
        self.arrived = threading.Condition()
        self.requests: list[dict] = []  # body + arrival time ("t") + answer time ("t_done")
        self.voices: dict[str, dict] = {}
        self.fail: dict[str, int] = {}  # text -> HTTP status to answer
        self.truncate: set[str] = set()  # texts whose body is cut short
        self.die_after: int | None = None  # stop serving after this many speech requests
        self.hang_after: int | None = None  # speech requests after this many are never answered (until stop)
        self.hang_registration = False  # voice registrations are never answered (until stop)
        self.trickle: set[str] = set()  # texts answered with headers, then a byte every 0.2 s for 20 s
        # text -> (bytes, declared): a WAV answer of that many bytes, generated as it is sent, with its
        # Content-Length (declared) or without (the body ends when the connection closes)
        self.oversize: dict[str, tuple[int, bool]] = {}
        self.sent: dict[str, int] = {}  # text -> body bytes an oversize answer got out before the client left
        self.paths: list[str] = []  # every request's path
        self.released = threading.Event()  # set on stop: hung requests end
        # text -> what to write as its capture instead of the real one: a dict of arrays, raw bytes,
        # or None (write nothing): hostile engines for the capture checks
        self.capture_override: dict = {}
        self.lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body: bytes, ctype="application/json", length=None):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body) if length is None else length))
                self.end_headers()
                self.wfile.write(body)

            def _route(self):
                outer.paths.append(self.path)
                p = self.path
                return p[len(outer.prefix):] if p.startswith(outer.prefix + "/") else None

            def do_GET(self):
                answers = {"/health": b'{"status":"healthy"}', "/version": b'{"version":"fake"}',
                           "/v1/models": b'{"data":[{"id":"fake-model","root":"fake"}]}'}
                path = self._route()
                if path in answers:
                    self._send(200, answers[path])
                else:
                    self._send(404, b'{"error":"not found"}')

            def _stream(self, text, size, declared):
                self.send_response(200)
                self.send_header("Content-Type", "audio/wav")
                if declared:
                    self.send_header("Content-Length", str(size))
                self.end_headers()
                outer.sent[text] = 0
                chunk = bytes(64 << 10)  # silence
                try:
                    self.wfile.write(wavio.encode(np.zeros(0, np.float32), 24000))  # data size 0: streamed
                    while outer.sent[text] < size:
                        self.wfile.write(chunk)
                        outer.sent[text] += len(chunk)
                except OSError:
                    pass
                self.close_connection = True

            def do_POST(self):
                data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                path = self._route()
                if path == "/v1/audio/voices":
                    if outer.hang_registration:
                        outer.released.wait(120)
                        return self.connection.close()
                    text = data.decode("latin-1")
                    name = text.split('name="name"\r\n\r\n')[1].split("\r\n")[0]
                    outer.voices[name] = {"bytes": len(data)}
                    return self._send(200, json.dumps({"name": name}).encode())
                if path != "/v1/audio/speech":
                    return self._send(404, b'{"error":"not found"}')
                body = json.loads(data)
                with outer.lock:
                    n = len(outer.requests)
                    if outer.die_after is not None and n >= outer.die_after:
                        threading.Thread(target=outer.stop, daemon=True).start()
                        self.connection.close()
                        return
                    rec = {**body, "t": time.monotonic(), "wave_header": self.headers.get("X-Difftest-Wave")}
                    outer.requests.append(rec)
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                if outer.hang_after is not None and n >= outer.hang_after:
                    outer.released.wait(120)
                    return self.connection.close()
                if body["input"] in outer.trickle:
                    self.send_response(200)
                    self.send_header("Content-Length", "1000000")
                    self.end_headers()
                    end = time.monotonic() + 20
                    while not outer.released.wait(0.2) and time.monotonic() < end:
                        try:
                            self.wfile.write(b"\0")
                            self.wfile.flush()
                        except OSError:
                            break
                    return
                if body["input"] in outer.oversize:
                    return self._stream(body["input"], *outer.oversize[body["input"]])
                if outer.gather:
                    with outer.arrived:
                        outer.arrived.notify_all()
                        group_end = (n // outer.gather + 1) * outer.gather
                        outer.arrived.wait_for(lambda: len(outer.requests) >= group_end, timeout=120)
                time.sleep(outer.delay)
                with outer.lock:
                    outer.in_flight -= 1
                    rec["t_done"] = time.monotonic()
                if body["input"] in outer.fail:
                    return self._send(outer.fail[body["input"]], b'{"error":{"message":"engine exploded"}}')
                seed = sum(body["input"].encode()) % 1000
                codes = toy_codes(body["max_new_tokens"] - 1, seed)
                ref = toy_codes(5, seed + 1) if "ref_audio" in body or "voice" in body else np.zeros((0, 16), int)
                wav = toy_decode(codes, ref)
                tag = body["extra_params"]["difftest_tag"]
                if outer.capture_dir and body["input"] in outer.capture_override:
                    bad = outer.capture_override[body["input"]]
                    if isinstance(bad, bytes):
                        (outer.capture_dir / f"{tag}.npz").write_bytes(bad)
                    elif bad is not None:
                        np.savez(outer.capture_dir / f"{tag}.npz", **bad)
                elif outer.capture_dir:
                    np.savez(outer.capture_dir / f"{tag}.npz", codes=codes, ref_codes=ref, wav=wav)
                audio = wavio.encode(wav, 24000, "pcm16")
                if body["input"] in outer.truncate:
                    return self._send(200, audio[: len(audio) // 2], "audio/wav", length=len(audio))
                self._send(200, audio, "audio/wav")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def stop(self):
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __exit__(self, *a):
        try:
            self.stop()
        except OSError:
            pass


def decode_ref_audio(body: dict) -> bytes:
    return base64.b64decode(body["ref_audio"].split(",", 1)[1])
