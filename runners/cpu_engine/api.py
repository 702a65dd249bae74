"""The speech API's requests: parsing and validation, without torch.

Everything a client can get wrong is found here and answered with a 4xx that
names the field, before the engine sees the request. Field names and meanings
follow vLLM-Omni's `/v1/audio/speech` (vllm_omni/entrypoints/openai/protocol/audio.py in 0.30):
`input`, `task_type` (Base / CustomVoice / VoiceDesign), `language`, `voice`,
`ref_audio` (a base64 data URL of a WAV), `ref_text`, `x_vector_only_mode`,
`instructions`, `seed`, `max_new_tokens`, `response_format` (wav | pcm),
`non_streaming_mode`, and `extra_params` {`temperature` (0: greedy),
`top_k`, `top_p`, `repetition_penalty`, `difftest_tag`}.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from email import policy
from email.parser import BytesParser
from pathlib import Path

from difftest.family import FAMILY, SAMPLE_RATE
from difftest.suites import wavio
from difftest.suites.voices import VoiceError, check_voice

TASK_OF_API = {api: task for task, api in FAMILY.tasks.items()}
API_OF_TASK = dict(FAMILY.tasks)
RESPONSE_FORMATS = ("wav", "pcm")
# vLLM-Omni's stage-0 defaults (deploy/qwen3_tts.yaml) when a request does not say.
DEFAULT_SAMPLING = {"temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05}
# qwen-tts's non_streaming_mode defaults, which vLLM-Omni copies (prompt_embeds_builder.py).
DEFAULT_NON_STREAMING = {"voice_clone": False, "custom_voice": True, "voice_design": True}
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")
VOICE_NAME_RE = re.compile(r"^[a-z0-9_][a-z0-9_.-]{0,127}$")


class BadRequest(ValueError):
    """A client error: HTTP `status` and a message that names the field."""

    def __init__(self, field_name: str | None, message: str, status: int = 400):
        self.field = field_name
        self.status = status
        super().__init__(f"{field_name}: {message}" if field_name else message)


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know about one loaded checkpoint (no torch)."""
    task: str
    languages: frozenset  # lower-case
    speakers: frozenset  # lower-case


@dataclass
class SpeechJob:
    """One validated request, ready for the engine."""
    text: str
    task: str
    language: str
    seed: int
    max_new_tokens: int
    do_sample: bool
    temperature: float | None
    top_k: int | None
    top_p: float | None
    repetition_penalty: float
    non_streaming_mode: bool
    response_format: str = "wav"
    tag: str | None = None
    voice_wav: Path | None = None  # voice clone: the reference wav on disk
    voice_sha256: str | None = None
    voice_name: str | None = None  # a registered voice, or None for inline ref_audio
    ref_text: str | None = None
    xvector_only: bool = False
    speaker: str | None = None
    instructions: str | None = None
    received: float = field(default_factory=time.time)

    def decode_params(self) -> dict:
        """What makes two requests decodable together (the seed is not here: see batch_key)."""
        d = {"do_sample": self.do_sample, "repetition_penalty": self.repetition_penalty,
             "max_new_tokens": self.max_new_tokens, "non_streaming_mode": self.non_streaming_mode}
        if self.do_sample:
            d.update(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        return d

    def batch_key(self, share_sampled: bool = False):
        """Requests with equal keys may share a batch. A sampled request gets None (runs alone,
        with its own seed) unless `share_sampled` (the shared-rng defect)."""
        if self.do_sample and not share_sampled:
            return None
        return (self.task, tuple(sorted(self.decode_params().items())))


# -- voices -------------------------------------------------------------
@dataclass(frozen=True)
class StoredVoice:
    name: str
    path: Path
    sha256: str
    ref_text: str | None
    n_samples: int  # frames at the file's own rate
    created: float
    sample_rate: int = SAMPLE_RATE  # as uploaded: qwen-tts resamples it to 24 kHz when it reads the file
    channels: int = 1  # as uploaded: qwen-tts mixes it down (channel mean) when it reads the file

    @property
    def seconds(self) -> float:
        return self.n_samples / self.sample_rate


class VoiceStore:
    """Reference wavs on disk (content-addressed, so qwen-tts reads them from a path exactly as
    the reference runner does) and the registered names that point at them."""

    def __init__(self, root: Path | None = None):
        self._tmp = None
        if root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="difftest-cpu-engine-voices-")
            root = Path(self._tmp.name)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._voices: dict[str, StoredVoice] = {}
        self._lock = threading.Lock()

    def put_wav(self, data: bytes) -> tuple[Path, str]:
        sha = hashlib.sha256(data).hexdigest()
        path = self.root / f"{sha}.wav"
        if not path.exists():
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return path, sha

    def register(self, name: str, data: bytes, ref_text: str | None) -> StoredVoice:
        path, sha = self.put_wav(data)
        wi = wavio.info(data)
        v = StoredVoice(name, path, sha, ref_text, wi.n_frames, time.time(), wi.sample_rate, wi.channels)
        with self._lock:
            self._voices[name] = v  # overwrite policy, like VLLM_OMNI_SPEAKER_REGISTRATION_POLICY=overwrite
        return v

    def get(self, name: str) -> StoredVoice | None:
        with self._lock:
            return self._voices.get(name)

    def list(self) -> list[StoredVoice]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda v: v.name)

    def close(self):
        if self._tmp is not None:
            self._tmp.cleanup()


def check_voice_wav(data: bytes, field_name: str) -> wavio.WavInfo:
    """A reference wav must pass the voice rule (difftest/suites/voices.py): PCM of 16 bits or
    more, mono or stereo, 8-48 kHz. It is stored as uploaded; qwen-tts reads the file itself, as the
    reference runner has it do (librosa: channel mean, then soxr_hq to 24 kHz), so a voice at
    another rate or in stereo gets exactly qwen-tts's treatment."""
    try:
        return check_voice(data)
    except VoiceError as e:
        raise BadRequest(field_name, str(e)) from None


def decode_ref_audio(value) -> bytes:
    """`ref_audio`: a base64 data URL (`data:audio/wav;base64,...`) or bare base64."""
    if not isinstance(value, str) or not value.strip():
        raise BadRequest("ref_audio", "must be a base64 data URL of a WAV file")
    s = value.strip()
    if s.startswith(("http://", "https://", "file://")):
        raise BadRequest("ref_audio", "URLs are not supported by this test engine; send a base64 data URL")
    if s.startswith("data:"):
        head, sep, s = s.partition(",")
        if not sep or ";base64" not in head:
            raise BadRequest("ref_audio", "data URL is not base64-encoded (expected data:audio/wav;base64,...)")
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadRequest("ref_audio", f"not valid base64 ({e})") from None


def parse_voice_upload(content_type: str, body: bytes) -> dict:
    """`POST /v1/audio/voices` multipart form: `audio_sample` (file), `name`, `consent`, optional
    `ref_text`. Returns {"name", "audio", "ref_text", "consent"}."""
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        raise BadRequest(None, "expected a multipart/form-data body", status=415)
    msg = BytesParser(policy=policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\nMIME-Version: 1.0\r\n\r\n" + body)
    if not msg.is_multipart():
        raise BadRequest(None, "the multipart body could not be parsed (boundary?)")
    fields: dict[str, bytes] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if name:
            fields[name] = part.get_payload(decode=True) or b""
    if "speaker_embedding" in fields and "audio_sample" not in fields:
        raise BadRequest("speaker_embedding", "is not supported by this test engine; upload audio_sample")
    if "audio_sample" not in fields:
        raise BadRequest("audio_sample", "is required (a PCM WAV file of 16 bits or more, mono or stereo, "
                                         "8-48 kHz)")
    raw_name = fields.get("name", b"").decode("utf-8", "replace").strip().lower()
    if not raw_name:
        raise BadRequest("name", "is required")
    if not VOICE_NAME_RE.match(raw_name):
        raise BadRequest("name", f"{raw_name!r} may hold only letters, digits, '_', '-' and '.'")
    consent = fields.get("consent", b"").decode("utf-8", "replace").strip()
    if not consent:
        raise BadRequest("consent", "is required")
    if consent.lower() in ("false", "0", "no"):
        raise BadRequest("consent", "was refused; a voice is stored only with consent")
    check_voice_wav(fields["audio_sample"], "audio_sample")
    ref_text = fields.get("ref_text", b"").decode("utf-8", "replace").strip() or None
    return {"name": raw_name, "audio": fields["audio_sample"], "ref_text": ref_text, "consent": consent}


# -- speech requests -------------------------------------------------------
def _number(d: dict, key: str, where: str, *, integer=False, lo=None, hi=None, lo_open=False):
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not float(v).is_integer()):
        raise BadRequest(where, f"expected {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v):
        raise BadRequest(where, f"must be finite, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise BadRequest(where, f"must be {'>' if lo_open else '>='} {lo}, got {v!r}")
    if hi is not None and v > hi:
        raise BadRequest(where, f"must be <= {hi}, got {v!r}")
    return int(v) if integer else float(v)


def _string(d: dict, key: str, where: str | None = None) -> str | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, str):
        raise BadRequest(where or key, f"expected a string, got {type(v).__name__}")
    return v


def _bool(d: dict, key: str, where: str | None = None) -> bool | None:
    v = d.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise BadRequest(where or key, f"expected true or false, got {v!r}")
    return v


def parse_speech(body, models: dict[str, ModelInfo], voices: VoiceStore) -> SpeechJob:
    """Validate a `/v1/audio/speech` JSON body against the loaded checkpoints and voices."""
    if not isinstance(body, dict):
        raise BadRequest(None, "the body must be a JSON object")
    text = _string(body, "input")
    if text is None or not text.strip():
        raise BadRequest("input", "is required (the text to speak)")
    if body.get("stream"):
        raise BadRequest("stream", "streaming is not supported by this test engine")
    sr = body.get("sample_rate")
    if sr is not None and sr != SAMPLE_RATE:
        raise BadRequest("sample_rate", f"only {SAMPLE_RATE} is supported, got {sr!r}")
    speed = body.get("speed")
    if speed is not None and speed != 1 and speed != 1.0:
        raise BadRequest("speed", f"only 1.0 is supported, got {speed!r}")
    fmt = _string(body, "response_format") or "wav"
    if fmt.lower() not in RESPONSE_FORMATS:
        raise BadRequest("response_format", f"{fmt!r} is not supported (supported: {', '.join(RESPONSE_FORMATS)})")
    fmt = fmt.lower()

    voice_name = _string(body, "voice")
    if voice_name is None:
        voice_name = _string(body, "speaker", "speaker")
    voice_name = voice_name.strip().lower() if voice_name else None
    ref_audio = body.get("ref_audio")
    ref_text = _string(body, "ref_text")
    xvec = _bool(body, "x_vector_only_mode")
    instructions = _string(body, "instructions")
    stored = voices.get(voice_name) if voice_name else None

    task_type = body.get("task_type")
    if task_type is not None:
        if task_type not in TASK_OF_API:
            raise BadRequest("task_type", f"unknown task type {task_type!r} (known: {', '.join(TASK_OF_API)})")
        task = TASK_OF_API[task_type]
    elif ref_audio is not None or ref_text is not None or stored is not None:
        task = "voice_clone"  # vLLM-Omni infers Base from a reference or a stored voice
    elif voice_name is not None and "custom_voice" in models:
        task = "custom_voice"
    elif instructions and "voice_design" in models:
        task = "voice_design"
    elif len(models) == 1:
        task = next(iter(models))
    else:
        raise BadRequest("task_type", "is required (Base, CustomVoice or VoiceDesign)")
    if task not in models:
        raise BadRequest("task_type", f"{API_OF_TASK[task]} needs a {task} checkpoint; this engine serves "
                                      f"{', '.join(API_OF_TASK[t] for t in models) or 'nothing'}")
    info = models[task]

    language = _string(body, "language") or "Auto"
    language = language.strip()
    if language.lower() not in info.languages:
        raise BadRequest("language", f"unsupported language {language!r} (known: "
                                     f"{', '.join(sorted(x.title() for x in info.languages))})")
    language = language.title()

    seed = _number(body, "seed", "seed", integer=True, lo=0, hi=2**63 - 1)
    max_new = _number(body, "max_new_tokens", "max_new_tokens", integer=True, lo=1, hi=4096)
    nsm = _bool(body, "non_streaming_mode")

    extra = body.get("extra_params")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise BadRequest("extra_params", f"expected an object, got {type(extra).__name__}")
    tag = extra.get("difftest_tag")
    if tag is not None and (not isinstance(tag, str) or not TAG_RE.match(tag)):
        raise BadRequest("extra_params.difftest_tag", f"{tag!r} must be 1-200 letters, digits, '_', '-', '.' "
                                                      f"(it names the capture file), not starting with '.' or '-'")
    temperature = _number(extra, "temperature", "extra_params.temperature", lo=0)
    top_k = _number(extra, "top_k", "extra_params.top_k", integer=True)
    top_p = _number(extra, "top_p", "extra_params.top_p", lo=0, hi=1, lo_open=True)
    rep = _number(extra, "repetition_penalty", "extra_params.repetition_penalty", lo=0, lo_open=True)
    do_sample = not (temperature is not None and temperature == 0)
    if top_k is not None and top_k < 0:
        top_k = 0  # vLLM's -1: no top-k; HF: 0

    job = SpeechJob(
        text=text, task=task, language=language,
        seed=seed if seed is not None else int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF,
        max_new_tokens=max_new if max_new is not None else max(192, 12 * len(text.encode("utf-8"))),
        do_sample=do_sample,
        temperature=(temperature if temperature is not None else DEFAULT_SAMPLING["temperature"]) if do_sample else None,
        top_k=(top_k if top_k is not None else DEFAULT_SAMPLING["top_k"]) if do_sample else None,
        top_p=(top_p if top_p is not None else DEFAULT_SAMPLING["top_p"]) if do_sample else None,
        repetition_penalty=rep if rep is not None else DEFAULT_SAMPLING["repetition_penalty"],
        non_streaming_mode=nsm if nsm is not None else DEFAULT_NON_STREAMING[task],
        response_format=fmt, tag=tag,
    )

    if task == "voice_clone":
        if ref_audio is not None and voice_name is not None:
            raise BadRequest("voice", "give a registered voice or ref_audio, not both")
        if ref_audio is not None:
            data = decode_ref_audio(ref_audio)
            check_voice_wav(data, "ref_audio")
            job.voice_wav, job.voice_sha256 = voices.put_wav(data)
            job.ref_text = ref_text.strip() if ref_text and ref_text.strip() else None
            job.xvector_only = bool(xvec)
        elif voice_name is not None:
            if stored is None:
                names = ", ".join(v.name for v in voices.list()) or "none"
                raise BadRequest("voice", f"unknown voice {voice_name!r} (registered: {names}); "
                                          f"upload it with POST /v1/audio/voices")
            job.voice_wav, job.voice_sha256, job.voice_name = stored.path, stored.sha256, stored.name
            job.ref_text = ref_text.strip() if ref_text and ref_text.strip() else stored.ref_text
            job.xvector_only = bool(xvec) if xvec is not None else job.ref_text is None
        else:
            raise BadRequest("ref_audio", "a Base (voice clone) request needs ref_audio or a registered voice")
        if not job.xvector_only and not job.ref_text:
            raise BadRequest("ref_text", "in-context cloning needs the reference transcript "
                                         "(or set x_vector_only_mode: true)")
    elif task == "custom_voice":
        if voice_name is None:
            raise BadRequest("voice", f"a CustomVoice request needs a speaker (known: {', '.join(sorted(info.speakers))})")
        if voice_name not in info.speakers:
            raise BadRequest("voice", f"unknown speaker {voice_name!r} (known: {', '.join(sorted(info.speakers))})")
        job.speaker = voice_name
        job.instructions = instructions or None
    else:
        if not instructions or not instructions.strip():
            raise BadRequest("instructions", "a VoiceDesign request needs instructions describing the voice")
        job.instructions = instructions
    return job
