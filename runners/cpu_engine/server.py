"""The HTTP surface: vLLM-Omni's speech API in front of the batching scheduler (no torch here).

    GET  /health              {"status": "healthy", "engine": "difftest-cpu-engine", "defect": ...}
    GET  /v1/engine           identity and provenance: a TEST ENGINE, never vLLM-Omni
    GET  /v1/models           the loaded checkpoints
    GET  /v1/audio/voices     built-in speakers and uploaded voices
    POST /v1/audio/voices     multipart: audio_sample, name, consent, optional ref_text
    POST /v1/audio/speech     JSON (api.py) -> 16-bit PCM WAV at 24 kHz, or raw PCM

A client error is a 4xx JSON `{"error": {"message", "type", "param", "code"}}`
naming the field; an exception in the engine is a 500 with its message, and
the server goes on. With a capture directory, each tagged request's codes,
reference codes and float waveform (as handed to and returned by the vocoder)
are written to `<dir>/<tag>.npz` atomically before the response is sent
(contract 5, docs/architecture.md).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import numpy as np

from difftest.compare.align import lead_of
from difftest.engines import capture
from difftest.family import CODEBOOKS
from difftest.suites import wavio
from runners.cpu_engine import ENGINE_NAME, LABEL
from runners.cpu_engine.api import API_OF_TASK, BadRequest, ModelInfo, VoiceStore, parse_speech, parse_voice_upload
from runners.cpu_engine.scheduler import Batcher, EngineStopped

MAX_BODY = 64 << 20


def log(message: str) -> None:
    print(f"[{LABEL}] {message}", file=sys.stderr, flush=True)


def write_capture(capture_dir: Path, tag: str, codes: np.ndarray, ref_codes: np.ndarray, wav: np.ndarray,
                  talker: dict | None = None) -> Path:
    """`<dir>/<tag>.npz` in the capture schema (difftest/engines/capture.py), with lead_samples (the
    sample qwen-tts's cut can leave before frame 0) and the talker's side; atomic and fsynced
    before the answer goes out."""
    codes = np.asarray(codes, np.int64).reshape(-1, CODEBOOKS)
    wav = np.asarray(wav, np.float32).reshape(-1)
    return capture.write(Path(capture_dir) / f"{tag}.npz", {
        "codes": codes, "ref_codes": ref_codes, "wav": wav, "lead_samples": lead_of(len(wav), len(codes)),
        **(talker or {})})


class EngineServer:
    """One engine configuration behind one HTTP listener."""

    def __init__(self, execute: Callable[[list], list], models: dict[str, ModelInfo], *, identity: dict,
                 defect: str | None = None, host: str = "127.0.0.1", port: int = 0, max_batch: int = 8,
                 batch_window_ms: float = 50.0, capture_dir: str | Path | None = None,
                 voices: VoiceStore | None = None, request_timeout_s: float = 900.0):
        self.models = models
        self.defect = defect
        self.identity = identity
        self.capture_dir = Path(capture_dir) if capture_dir else None
        if self.capture_dir is not None:
            self.capture_dir.mkdir(parents=True, exist_ok=True)
        self.voices = voices or VoiceStore()
        self.request_timeout_s = request_timeout_s
        self.batcher = Batcher(execute, max_batch=max_batch, window_s=batch_window_ms / 1000.0, log=log)
        self.started = time.time()
        self.counts = {"requests": 0, "ok": 0, "client_errors": 0, "engine_errors": 0}
        self._lock = threading.Lock()
        outer = self

        class Handler(_Handler):
            server_ref = outer

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.host, self.port = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="cpu-engine-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "EngineServer":
        self.batcher.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.batcher.stop()
        self.voices.close()

    def serve_forever(self) -> None:
        self.batcher.start()
        try:
            self.httpd.serve_forever(poll_interval=0.1)
        finally:
            self.batcher.stop()
            self.httpd.server_close()
            self.voices.close()

    def count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def engine_info(self) -> dict:
        return {**self.identity, "uptime_s": round(time.time() - self.started, 1),
                "batches_run": self.batcher.batches_run,
                "batch_sizes": _histogram(self.batcher.batch_sizes), "counts": dict(self.counts)}


def _histogram(sizes: list[int]) -> dict:
    out: dict[str, int] = {}
    for s in sizes:
        out[str(s)] = out.get(str(s), 0) + 1
    return out


def _wave(value: str | None) -> tuple[int | None, str | None]:
    """X-Difftest-Wave: `N` or `N;ID`, how many requests the client released together and which wave
    (runners/cpu_engine/scheduler.py). A hint only: a count that is not a positive integer is ignored."""
    count, _, wave_id = (value or "").partition(";")
    try:
        n = int(count)
    except ValueError:
        return None, None
    return (n, wave_id.strip() or None) if n > 0 else (None, None)


class _Handler(BaseHTTPRequestHandler):
    server_ref: EngineServer
    server_version = "difftest-cpu-engine"

    def log_message(self, fmt, *args):  # the engine logs its own lines
        pass

    # -- answers ---------------------------------------------------------
    def _send(self, status: int, body: bytes, ctype: str = "application/json", headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Difftest-Engine", ENGINE_NAME)
        self.send_header("X-Difftest-Defect", self.server_ref.defect or "none")
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj, allow_nan=False).encode())

    def _error(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        self._json(status, {"error": {"message": message, "type": kind, "param": param, "code": status}})

    def _body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None:
            self._error(411, "a Content-Length header is required", "BadRequestError")
            return None
        try:
            n = int(length)
        except ValueError:
            self._error(400, f"bad Content-Length {length!r}", "BadRequestError")
            return None
        if n < 0 or n > MAX_BODY:
            self.close_connection = True
            self._error(413, f"body of {n} bytes; at most {MAX_BODY}", "BadRequestError")
            return None
        return self.rfile.read(n)

    # -- routes ----------------------------------------------------------
    def do_GET(self):
        s = self.server_ref
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        if path == "/health":
            return self._json(200, {"status": "healthy", "engine": ENGINE_NAME, "defect": s.defect})
        if path in ("/v1/engine", "/engine"):
            return self._json(200, s.engine_info())
        if path == "/v1/models":
            data = [{"id": m["model"], "object": "model", "owned_by": ENGINE_NAME, "task_type": API_OF_TASK[t],
                     "sha256": m["sha256"]} for t, m in s.identity.get("models", {}).items()]
            return self._json(200, {"object": "list", "data": data})
        if path == "/v1/audio/voices":
            speakers = sorted({sp for m in s.models.values() for sp in m.speakers})
            uploaded = [{"name": v.name, "sha256": v.sha256, "ref_text": v.ref_text,
                         "mode": "icl" if v.ref_text else "xvector", "seconds": v.seconds,
                         "created_at": int(v.created)} for v in s.voices.list()]
            return self._json(200, {"voices": speakers + [v["name"] for v in uploaded], "uploaded_voices": uploaded})
        if path in ("/v1/audio/speech",):
            return self._error(405, f"use POST for {path}", "MethodNotAllowed")
        return self._error(404, f"no route {self.path}", "NotFoundError")

    def do_HEAD(self):
        self.do_GET()

    def do_POST(self):
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in ("/v1/audio/speech", "/v1/audio/voices"):
            body = self._body()  # keep the connection in step
            if body is not None:
                self._error(404, f"no route {self.path}", "NotFoundError")
            return
        body = self._body()
        if body is None:
            return
        try:
            if path == "/v1/audio/voices":
                self._register_voice(body)
            else:
                self._speech(body)
        except BadRequest as e:
            self.server_ref.count("client_errors")
            log(f"{self.command} {path}: {e.status} {e}")
            self._error(e.status, str(e), "BadRequestError", e.field)
        except Exception as e:  # a bug here must not take the server down
            self.server_ref.count("engine_errors")
            log(f"{self.command} {path}: 500 {type(e).__name__}: {e}")
            self._error(500, f"{type(e).__name__}: {e}", "InternalServerError")

    def _register_voice(self, body: bytes) -> None:
        s = self.server_ref
        form = parse_voice_upload(self.headers.get("Content-Type", ""), body)
        if "voice_clone" not in s.models:
            raise BadRequest(None, "this engine serves no Base checkpoint; voices cannot be used")
        v = s.voices.register(form["name"], form["audio"], form["ref_text"])
        log(f"registered voice {v.name!r} ({v.seconds:.2f} s at {v.sample_rate} Hz, {v.channels} ch, "
            f"sha256 {v.sha256[:12]}, {'icl' if v.ref_text else 'xvector'})")
        self._json(200, {"success": True, "voice": {"name": v.name, "sha256": v.sha256, "ref_text": v.ref_text,
                                                    "mode": "icl" if v.ref_text else "xvector"}})

    def _speech(self, body: bytes) -> None:
        s = self.server_ref
        s.count("requests")
        wave = _wave(self.headers.get("X-Difftest-Wave"))
        try:
            try:
                obj = json.loads(body)
            except (ValueError, UnicodeDecodeError) as e:
                raise BadRequest(None, f"the body is not valid JSON ({e})") from None
            job = parse_speech(obj, s.models, s.voices)
        except BaseException:
            s.batcher.settled(wave[1])  # refused: its wave-mates' batch does not wait for it
            raise
        t0 = time.perf_counter()
        try:
            pending = s.batcher.submit(job, job.batch_key(share_sampled=s.defect == "shared-rng"), *wave)
            out = pending.wait(s.request_timeout_s)
        except EngineStopped as e:
            s.count("engine_errors")
            return self._error(503, str(e), "ServiceUnavailable")
        except TimeoutError as e:
            s.count("engine_errors")
            return self._error(504, str(e), "Timeout")
        except Exception as e:
            s.count("engine_errors")
            log(f"speech tag={job.tag}: engine error {type(e).__name__}: {e}")
            return self._error(500, f"engine error: {type(e).__name__}: {e}", "InternalServerError")
        seconds = time.perf_counter() - t0
        if s.capture_dir is not None and job.tag:
            write_capture(s.capture_dir, job.tag, out.codes, out.ref_codes, out.wav, out.talker)
        if job.response_format == "pcm":
            audio, ctype = wavio.pcm16(out.wav).tobytes(), "audio/pcm"
        else:
            audio, ctype = wavio.encode(out.wav, out.sample_rate, "pcm16"), "audio/wav"
        s.count("ok")
        log(f"speech tag={job.tag} task={job.task} frames={out.codes.shape[0]} ref={out.ref_codes.shape[0]} "
            f"batch={pending.batch_id} ({pending.batch_index + 1}/{pending.batch_size}) {seconds:.2f} s")
        self._send(200, audio, ctype, {
            "X-Difftest-Batch-Id": pending.batch_id, "X-Difftest-Batch-Size": pending.batch_size,
            "X-Difftest-Batch-Index": pending.batch_index, "X-Difftest-Frames": out.codes.shape[0],
            "X-Difftest-Ref-Frames": out.ref_codes.shape[0], "X-Difftest-Seed": job.seed,
            "X-Difftest-Sample-Rate": out.sample_rate,
        })
