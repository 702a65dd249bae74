"""Result artifacts and the result store (contracts 1 and 2, docs/architecture.md).

One result per (runner configuration, segment): `<stem>.npz` holding `codes`
(T, 16), `ref_codes` (R, 16) and `wav` (float32 mono), plus `<stem>.json`, the
sidecar. The sidecar is written last and records the npz's sha256, so it is the
commit marker: a crash between the two writes, a truncated npz or a hand-edited
file all read as "missing", never as a result to trust.

This module is imported by runners too (it needs only numpy), so every engine
writes the same files.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .engines.capture import CaptureError, member_sizes
from .errors import BadInput
from .family import CODEBOOKS
from .suites.suite import content_hash

log = logging.getLogger(__name__)

FORMAT = "difftest.result/1"


class CorruptResult(ValueError):
    """A result file that must not be trusted; the message names file and problem."""


@dataclass
class Result:
    segment_id: str
    segment_hash: str
    wav: np.ndarray
    sample_rate: int
    codes: np.ndarray = field(default_factory=lambda: np.zeros((0, CODEBOOKS), np.int64))
    ref_codes: np.ndarray = field(default_factory=lambda: np.zeros((0, CODEBOOKS), np.int64))
    has_codes: bool = True  # False: audio-only candidate (no capture); codes are empty then
    quantised: bool = False  # True when the audio went through 16-bit PCM (HTTP WAV)
    provenance: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)  # runner label, concurrency, tag, ...
    extra: dict = field(default_factory=dict)  # further named arrays (e.g. vocoder_input)
    source: Path | None = field(default=None, compare=False)  # the sidecar it was read from

    def __post_init__(self):
        self.wav = np.asarray(self.wav, dtype=np.float32).reshape(-1)
        self.codes = _codes(self.codes, "codes")
        self.ref_codes = _codes(self.ref_codes, "ref_codes")

    @property
    def seconds(self) -> float:
        return len(self.wav) / self.sample_rate if self.sample_rate else 0.0

    @property
    def lead_samples(self) -> int:
        """Samples before frame 0 (qwen-tts's proportional cut can leave one; difftest.compare.align)."""
        return int(self.meta.get("lead_samples") or 0)

    @property
    def grid_wav(self) -> np.ndarray:
        """The audio from frame 0 on: what comparisons align."""
        return self.wav[self.lead_samples:]


def _codes(a, name: str) -> np.ndarray:
    a = np.asarray(a)
    if a.size == 0:
        return np.zeros((0, CODEBOOKS), np.int64)
    if a.ndim != 2 or a.shape[1] != CODEBOOKS:
        raise ValueError(f"{name} must have shape (T, {CODEBOOKS}), got {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got {a.dtype}")
    return a.astype(np.int64)


def _ext(stem: Path, ext: str) -> Path:
    """stem + ext; stems hold dots (`<segment>.<hash>`), so with_suffix would eat the hash."""
    return stem.with_name(stem.name + ext)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once: os.umask can only be read by setting it


def atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file and a rename: a reader never sees half a file. The file gets the
    user's umask, as open() would give it (mkstemp alone makes it private: 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_result(stem: str | Path, result: Result) -> Path:
    """Write `<stem>.npz` then `<stem>.json`, each atomically. Returns the sidecar path."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"codes": result.codes, "ref_codes": result.ref_codes, "wav": result.wav}
    for k, v in result.extra.items():
        if k in arrays:
            raise ValueError(f"extra array name {k!r} clashes with a contract field")
        arrays[k] = np.asarray(v)

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    blob = buf.getvalue()
    npz = _ext(stem, ".npz")
    atomic_write(npz, blob)
    sidecar = {
        "format": FORMAT,
        "segment_id": result.segment_id,
        "segment_hash": result.segment_hash,
        "sample_rate": result.sample_rate,
        "has_codes": result.has_codes,
        "quantised": result.quantised,
        "npz": npz.name,
        "npz_sha256": hashlib.sha256(blob).hexdigest(),
        "shapes": {k: list(np.shape(v)) for k, v in arrays.items()},
        "provenance": result.provenance,
        "timings": result.timings,
        "meta": result.meta,
    }
    side = _ext(stem, ".json")
    atomic_write(side, json.dumps(sidecar, indent=1, sort_keys=True, allow_nan=False).encode())
    return side


def read_sidecar(sidecar: str | Path, fmt: str) -> tuple[dict, bytes]:
    """A sidecar of format `fmt` and the npz it commits to, its sha256 checked: (meta, npz bytes).
    CorruptResult names the file and the problem. Shared by result and score files."""
    side = Path(sidecar)
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        raise CorruptResult(f"{side}: missing") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptResult(f"{side}: sidecar is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        raise CorruptResult(f"{side}: not a {fmt} sidecar")
    npz = side.with_name(meta.get("npz") or side.name[: -len(".json")] + ".npz")
    try:
        blob = npz.read_bytes()
    except FileNotFoundError:
        raise CorruptResult(f"{npz}: missing (sidecar present)") from None
    if hashlib.sha256(blob).hexdigest() != meta.get("npz_sha256"):
        raise CorruptResult(f"{npz}: content does not match its sidecar's sha256 (truncated or changed)")
    return meta, blob


def read_result(sidecar: str | Path) -> Result:
    """Read a result by its sidecar path; raises CorruptResult if anything is off."""
    side = Path(sidecar)
    meta, blob = read_sidecar(side, FORMAT)
    npz = side.with_name(meta.get("npz") or side.name[: -len(".json")] + ".npz")
    try:
        member_sizes(io.BytesIO(blob), npz)  # bounded memory: a small npz may claim gigabytes
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except CaptureError as e:
        raise CorruptResult(str(e)) from None
    except Exception as e:  # a bad zip, a pickled array: either way untrusted
        raise CorruptResult(f"{npz}: unreadable npz ({e})") from None
    for k in ("codes", "ref_codes", "wav"):
        if k not in arrays:
            raise CorruptResult(f"{npz}: array {k!r} missing")
    try:
        return Result(
            segment_id=meta["segment_id"], segment_hash=meta["segment_hash"],
            wav=arrays.pop("wav"), sample_rate=int(meta["sample_rate"]),
            codes=arrays.pop("codes"), ref_codes=arrays.pop("ref_codes"),
            has_codes=bool(meta.get("has_codes", True)), quantised=bool(meta.get("quantised", False)),
            provenance=meta.get("provenance", {}), timings=meta.get("timings", {}),
            meta=meta.get("meta", {}), extra=arrays, source=side.resolve(),
        )
    except (KeyError, ValueError) as e:
        raise CorruptResult(f"{side}: {e}") from None


def load_result_set(directory: str | Path) -> tuple[dict[str, Result], list[str]]:
    """Every result in a directory, by segment id, and warnings for files skipped."""
    directory = Path(directory)
    results, warnings = {}, []
    for side in sorted(directory.glob("*.json")):
        try:
            head = json.loads(side.read_text())
        except (ValueError, UnicodeDecodeError):
            head = None
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            continue  # not a result sidecar (config.json, report.json, ...)
        try:
            r = read_result(side)
        except CorruptResult as e:
            warnings.append(f"ignored corrupt result: {e}")
            continue
        if r.segment_id in results:
            warnings.append(f"{side}: second result for segment {r.segment_id!r}; keeping the first")
            continue
        results[r.segment_id] = r
    return results, warnings


class ResultStore:
    """Results on disk, keyed by runner configuration and segment content hash.

    Layout: `<root>/<label>-<config key[:16]>/<segment id>.<segment hash[:16]>.{npz,json}`,
    with `config.json` in each configuration folder recording what the key covers.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)

    @staticmethod
    def config_key(fingerprint: dict) -> str:
        return content_hash(fingerprint)

    def config_dir(self, label: str, fingerprint: dict) -> Path:
        d = self.root / f"{label}-{self.config_key(fingerprint)[:16]}"
        if not (d / "config.json").is_file():
            d.mkdir(parents=True, exist_ok=True)
            atomic_write(d / "config.json",
                          json.dumps({"label": label, "fingerprint": fingerprint}, indent=1, sort_keys=True).encode())
        return d

    @staticmethod
    def stem(config_dir: Path, segment_id: str, segment_hash: str) -> Path:
        return config_dir / f"{segment_id}.{segment_hash[:16]}"

    def get(self, config_dir: Path, segment_id: str, segment_hash: str) -> Result | None:
        """The cached result, or None when absent or untrustworthy (with a warning)."""
        side = _ext(self.stem(config_dir, segment_id, segment_hash), ".json")
        if not side.exists():
            return None
        try:
            r = read_result(side)
        except CorruptResult as e:
            log.warning("treating as missing: %s", e)
            return None
        if r.segment_hash != segment_hash:
            log.warning("treating as missing: %s holds segment hash %s", side, r.segment_hash[:16])
            return None
        return r

    def put(self, config_dir: Path, result: Result) -> Path:
        return write_result(self.stem(config_dir, result.segment_id, result.segment_hash), result)


def reusable_together(found: dict[str, Result]) -> dict[str, Result]:
    """The found results that may be reused: those whose every peer (`meta.wave`, the wave it was
    sent in, or `meta.batch`, the batch it was decoded in) is itself found and reused. A result whose
    wave-mate changed (another text, voice or decode: another hash, so not found) must be served
    again with its wave: reused alone, the changed segment would be served alone, and a leak between
    them would pass."""
    keep = dict(found)
    while True:
        drop = [sid for sid, r in keep.items()
                if any(p not in keep for p in (r.meta.get("wave") or r.meta.get("batch") or [sid]))]
        if not drop:
            return keep
        for sid in drop:
            del keep[sid]


def prepare_out(path, flag: str = "--out") -> Path:
    """A folder difftest writes into (the run folder, the store), created; BadInput naming it when
    it cannot be one (a file, read-only, under a file)."""
    out = Path(path).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".difftest-write-check.", delete=True)
        probe.close()
    except (FileExistsError, NotADirectoryError):
        raise BadInput(f"{flag} {path}: exists and is not a folder (or lies under a file)") from None
    except OSError as e:
        raise BadInput(f"{flag} {path}: cannot write there ({e.strerror or e})") from None
    return out
