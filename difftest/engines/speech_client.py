"""A client for vLLM-Omni's OpenAI-compatible speech API (contract 4, docs/architecture.md).

Only the standard library: `GET /health`, `POST /v1/audio/voices` (multipart),
`POST /v1/audio/speech` (JSON in, WAV out), under the URL's path (a server behind
a reverse proxy). Connection failures are retried a bounded number of times and
counted; an HTTP error or a truncated body is an answer, never retried. Each
request has a deadline for its whole answer (RequestTimeout), and an answer may
not be larger than its request allows (answer_bound): read in pieces, refused as
soon as it is.
"""

from __future__ import annotations

import base64
import http.client
import json
import math
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME
from ..suites.suite import API_TASK_TYPE, Segment, Voice
from ..suites.voices import MAX_SECONDS

HEADER_ALLOWANCE = 64 << 10  # a WAV's header and any metadata chunks
MAX_OTHER_BYTES = 16 << 20  # any answer but a speech one (health, version, models, a voice's registration)
READ_PIECE = 1 << 20


class SpeechError(Exception):
    """The server answered, but not with audio: `status` and the server's message."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class RequestTimeout(SpeechError):
    """No whole answer within the request timeout: the server is hung (status 0, as a lost connection)."""

    def __init__(self, message: str):
        self.status = 0
        Exception.__init__(self, message)


class ServerUnreachable(Exception):
    """No connection could be made (after the allowed retries)."""


def answer_bound(body: dict) -> int:
    """The most bytes a speech answer to `body` may hold: float32 samples at 24 kHz for its
    max_new_tokens frames plus, for a voice clone, the longest reference a suite accepts (a server
    that leaves it in the stream: the frames capture.validate allows), and a header allowance."""
    ref = math.ceil(MAX_SECONDS * SAMPLE_RATE / SAMPLES_PER_FRAME) if body.get("task_type") == "Base" else 0
    return (int(body.get("max_new_tokens") or 0) + ref) * SAMPLES_PER_FRAME * 4 + HEADER_ALLOWANCE


@dataclass
class SpeechAnswer:
    audio: bytes
    headers: dict
    retries: int
    seconds: float


def speech_request(segment: Segment, tag: str, *, voice_mode: str = "inline", model: str | None = None,
                   response_format: str = "wav") -> dict:
    """The JSON body for one segment. Always `seed`, `max_new_tokens` (vLLM-Omni retries silently
    with a random seed otherwise), the sampling settings, and the tag in `extra_params`."""
    d = segment.decode
    extra = {"difftest_tag": tag, "repetition_penalty": d["repetition_penalty"]}
    if d.get("do_sample"):
        extra.update({k: d[k] for k in ("temperature", "top_k", "top_p") if k in d})
    else:
        extra["temperature"] = 0.0  # greedy talker
    body = {
        "input": segment.text,
        "task_type": API_TASK_TYPE[segment.task],
        "language": segment.language,
        "seed": d["seed"],
        "max_new_tokens": d["max_new_tokens"],
        "response_format": response_format,
        "extra_params": extra,
    }
    if model:
        body["model"] = model
    if "non_streaming_mode" in d:
        body["non_streaming_mode"] = d["non_streaming_mode"]
    if segment.instructions:
        body["instructions"] = segment.instructions
    if segment.task == "custom_voice":
        body["voice"] = segment.speaker
    elif segment.task == "voice_clone":
        v = segment.voice
        if voice_mode == "registered":
            body["voice"] = registered_name(v)
        else:
            b64 = base64.b64encode(v.wav.read_bytes()).decode()
            body["ref_audio"] = f"data:audio/wav;base64,{b64}"
            if v.mode == "icl":
                body["ref_text"] = v.transcript
        if v.mode == "xvector":
            body["x_vector_only_mode"] = True
    return body


def registered_name(voice: Voice) -> str:
    """A server-side voice name tied to the content, so a changed wav never reuses a stale upload."""
    return f"difftest-{voice.id}-{voice.wav_sha256[:10]}".lower()


class SpeechClient:
    def __init__(self, base_url: str, *, timeout: float = 600.0, connect_retries: int = 3,
                 retry_wait: float = 1.0):
        u = urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.prefix = u.path.rstrip("/")  # a server mounted under a path
        self.base_url = f"{u.scheme}://{u.netloc}{self.prefix}"
        self._conn_args = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))
        self.timeout = timeout
        self.connect_retries = connect_retries
        self.retry_wait = retry_wait

    def _request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                 timeout: float | None = None, max_bytes: int = MAX_OTHER_BYTES,
                 why: str = "") -> tuple[int, dict, bytes, int]:
        scheme, host, port = self._conn_args
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        timeout = timeout or self.timeout
        retries = 0
        while True:
            conn = cls(host, port, timeout=timeout)
            try:
                conn.connect()
            except TimeoutError:  # not refused but not answering either: waiting again would not help
                conn.close()
                raise ServerUnreachable(f"{self.base_url}: no connection within {timeout:g} s") from None
            except OSError as e:
                conn.close()
                if retries >= self.connect_retries:
                    raise ServerUnreachable(f"{self.base_url}: {e}") from None
                retries += 1
                time.sleep(self.retry_wait * retries)
                continue
            # The whole answer's deadline: a socket's timeout is per read, which a trickle never trips.
            expired = threading.Event()
            timer = threading.Timer(timeout, _abort, (conn, expired))
            timer.daemon = True
            timer.start()
            try:
                conn.request(method, self.prefix + path, body=body, headers=headers or {})
                resp = conn.getresponse()
                data = _read(resp, max_bytes, why, expired)
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, retries
            except (OSError, http.client.HTTPException) as e:
                if expired.is_set() or isinstance(e, TimeoutError):
                    raise RequestTimeout(f"{self.base_url}: no answer within {timeout:g} s "
                                         f"(--request-timeout)") from None
                if isinstance(e, http.client.IncompleteRead):
                    raise SpeechError(resp.status, f"truncated body: {len(e.partial)} bytes of "
                                                   f"{len(e.partial) + (e.expected or 0)}") from None
                if isinstance(e, OSError):  # it reached the server, which then went away: an answer, not a retry
                    raise SpeechError(0, f"connection lost mid-request: {type(e).__name__}") from None
                raise SpeechError(0, f"not an HTTP answer: {type(e).__name__}: {str(e)[:200]}") from None
            finally:
                timer.cancel()
                conn.close()

    def health(self, timeout: float = 5.0) -> bool:
        try:
            status, _, _, _ = self._request("GET", "/health", timeout=timeout)
        except (ServerUnreachable, SpeechError):
            return False
        return status == 200

    def server_info(self, timeout: float = 10.0) -> dict:
        """What the server says of itself (vLLM's GET /version and GET /v1/models), for the identity
        of its results; a path it does not serve is recorded as None."""
        info = {}
        for key, path in (("version", "/version"), ("models", "/v1/models")):
            try:
                status, _, data, _ = self._request("GET", path, timeout=timeout)
                body = json.loads(data) if status == 200 else None
            except (ServerUnreachable, SpeechError, ValueError):
                body = None
            if key == "models" and isinstance(body, dict):  # ids and roots; not the creation times
                body = sorted(json.dumps({k: m.get(k) for k in ("id", "root", "max_model_len")}, sort_keys=True)
                              for m in body.get("data") or [] if isinstance(m, dict))
            info[key] = body
        return info

    def register_voice(self, voice: Voice) -> str:
        name = registered_name(voice)
        boundary = uuid.uuid4().hex
        fields = {"name": name, "consent": "true"}
        if voice.mode == "icl":
            fields["ref_text"] = voice.transcript
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                 for k, v in fields.items()]
        parts.append((f'--{boundary}\r\nContent-Disposition: form-data; name="audio_sample"; '
                      f'filename="{voice.id}.wav"\r\nContent-Type: audio/wav\r\n\r\n').encode()
                     + voice.wav.read_bytes() + b"\r\n")
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        status, _, data, _ = self._request("POST", "/v1/audio/voices", body,
                                           {"Content-Type": f"multipart/form-data; boundary={boundary}"})
        if status >= 300:
            raise SpeechError(status, f"registering voice {voice.id}: {_message(data)}")
        return name

    def speech(self, body: dict, extra_headers: dict | None = None) -> SpeechAnswer:
        t0 = time.perf_counter()
        sent = {"Content-Type": "application/json", **(extra_headers or {})}
        status, headers, data, retries = self._request(
            "POST", "/v1/audio/speech", json.dumps(body).encode(), sent, max_bytes=answer_bound(body),
            why=f"max_new_tokens {body.get('max_new_tokens')} allows")
        if status != 200:
            raise SpeechError(status, _message(data))
        return SpeechAnswer(data, headers, retries, time.perf_counter() - t0)


    def chat(self, body: dict, max_bytes: int) -> SpeechAnswer:
        """POST /v1/chat/completions; the answer's JSON bytes (at most `max_bytes`) as `audio`."""
        t0 = time.perf_counter()
        status, headers, data, retries = self._request(
            "POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"},
            max_bytes=max_bytes, why="the talker's max_tokens allows")
        if status != 200:
            raise SpeechError(status, _message(data))
        return SpeechAnswer(data, headers, retries, time.perf_counter() - t0)


def _abort(conn, expired: threading.Event) -> None:
    """The deadline passed: end the connection, so a read blocked on it returns now."""
    expired.set()
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except (OSError, AttributeError):
        pass


def _read(resp, max_bytes: int, why: str, expired: threading.Event) -> bytes:
    """The body, in pieces: refused as soon as it is over `max_bytes` (a Content-Length over it,
    before any is read); http.client.IncompleteRead when shorter than its Content-Length;
    TimeoutError once `expired`."""
    why = why or "allowed"
    declared = resp.getheader("Content-Length", "")
    declared = int(declared) if declared.isdigit() else None
    if declared is not None and declared > max_bytes:
        raise SpeechError(resp.status, f"an answer of {declared} bytes (Content-Length), more than the "
                                       f"{max_bytes} bytes {why}; not read")
    parts, size = [], 0
    while not expired.is_set() and (piece := resp.read1(READ_PIECE)):
        size += len(piece)
        if size > max_bytes:
            raise SpeechError(resp.status, f"an answer of more than the {max_bytes} bytes {why} "
                                           f"({size} read); the rest not read")
        parts.append(piece)
    if expired.is_set():
        raise TimeoutError
    data = b"".join(parts)
    if declared is not None and size < declared:
        raise http.client.IncompleteRead(data, declared - size)
    return data


def _message(data: bytes) -> str:
    try:
        j = json.loads(data)
        if isinstance(j, dict):
            err = j.get("error", j.get("detail", j))
            if isinstance(err, dict):
                err = err.get("message", err)
            return str(err)[:500]
    except ValueError:
        pass
    return data[:500].decode("utf-8", "replace")
