"""A client for vLLM-Omni's OpenAI-compatible speech API (contract 4, docs/architecture.md).

Only the standard library: `GET /health`, `POST /v1/audio/voices` (multipart),
`POST /v1/audio/speech` (JSON in, WAV out). Connection failures are retried a
bounded number of times and counted; an HTTP error or a truncated body is an
answer, never retried.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import time
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..suites.suite import API_TASK_TYPE, Segment, Voice


class SpeechError(Exception):
    """The server answered, but not with audio: `status` and the server's message."""

    def __init__(self, status: int, message: str):
        self.status = status
        super().__init__(f"HTTP {status}: {message}")


class ServerUnreachable(Exception):
    """No connection could be made (after the allowed retries)."""


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
        self.base_url = f"{u.scheme}://{u.netloc}"
        self._conn_args = (u.scheme, u.hostname, u.port or (443 if u.scheme == "https" else 80))
        self.timeout = timeout
        self.connect_retries = connect_retries
        self.retry_wait = retry_wait

    def _request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                 timeout: float | None = None) -> tuple[int, dict, bytes, int]:
        scheme, host, port = self._conn_args
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        retries = 0
        while True:
            conn = cls(host, port, timeout=timeout or self.timeout)
            try:
                try:
                    conn.connect()
                except (ConnectionRefusedError, socket.gaierror, OSError) as e:
                    if retries >= self.connect_retries:
                        raise ServerUnreachable(f"{self.base_url}: {e}") from None
                    retries += 1
                    time.sleep(self.retry_wait * retries)
                    continue
                conn.request(method, path, body=body, headers=headers or {})
                resp = conn.getresponse()
                try:
                    data = resp.read()
                except http.client.IncompleteRead as e:
                    raise SpeechError(resp.status, f"truncated body: {len(e.partial)} bytes of "
                                                   f"{len(e.partial) + (e.expected or 0)}") from None
                return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data, retries
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected) as e:
                # The request reached the server, which then went away: an answer, not a retry.
                raise SpeechError(0, f"connection lost mid-request: {type(e).__name__}") from None
            except socket.timeout:
                raise SpeechError(0, f"no answer within {timeout or self.timeout:.0f} s") from None
            finally:
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
        status, headers, data, retries = self._request("POST", "/v1/audio/speech", json.dumps(body).encode(), sent)
        if status != 200:
            raise SpeechError(status, _message(data))
        return SpeechAnswer(data, headers, retries, time.perf_counter() - t0)


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
