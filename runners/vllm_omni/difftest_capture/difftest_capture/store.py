"""Capture files on disk: numpy only (no torch), shared by every process of the server.

Two processes write to one request's file: the talker stage (codes, reference
codes) and the vocoder stage (waveform). Each update is a read-merge-write of
`<dir>/<tag>.npz` under an exclusive lock on `<dir>/.difftest-capture/locks/<tag>`,
and the write is a temporary file renamed over the old one, so a reader never
sees a half file and neither writer loses the other's arrays.

The talker's worker knows a request only by id. It files the talker's input
(`talker/<h>.arrays`, store.pack) and, step by step, the talker's own top-k log-probabilities
(`talker/<h>.steps`, fixed-size binary records appended in order) under a hash
of the id; the hand-off, which knows the tag, takes them.

The vocoder never sees the request's tag; it sees the codes. The talker side
therefore files each payload it hands over under the sha256 of its codes
(`handoff/<sha>`: the tag and request id), and the vocoder side looks its
input up there.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from difftest.engines import capture  # installed beside this plugin by make_env.sh (numpy only)

_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
SIDE = ".difftest-capture"


TOP_K = 5  # the talker's own candidates kept per step: enough for a near-tie's top-3 and its margin


def step_dtype(k: int = TOP_K) -> np.dtype:
    """One talker step: its output position (-1: unknown), the top-k token ids and their log-probabilities."""
    return np.dtype([("pos", "<i4"), ("ids", "<i4", (k,)), ("logprobs", "<f4", (k,))])


def valid_tag(tag) -> bool:
    """Tags become file names: letters, digits, '.', '_', '-', at most 200, not starting with a dot."""
    return isinstance(tag, str) and bool(_TAG.match(tag))


def codes_key(flat_codes: np.ndarray) -> str:
    a = np.ascontiguousarray(np.asarray(flat_codes, dtype=np.int64).reshape(-1))
    return hashlib.sha256(a.tobytes()).hexdigest()


def pack_parts(arrays: dict) -> list:
    """Arrays as the parts of one blob, for the plugin's own side files (never the tester's): a
    length, a JSON header of name -> (dtype, shape, offset), then the raw bytes. An npz costs a zip
    member per array, about ten times as much, on the talker's worker, once per request. A large
    contiguous numeric array (the prompt rows) is a view of its own bytes, not a copy."""
    header, chunks, offset = {}, [], 0
    for name, value in arrays.items():
        a = np.asarray(value)  # not ascontiguousarray: it makes a 0-d array 1-d; tobytes is C order anyway
        if a.dtype.hasobject:
            raise ValueError(f"{name}: object arrays are not filed")
        header[name] = (a.dtype.str, list(a.shape), offset)
        big = a.nbytes >= 1 << 16 and a.dtype.kind in "biuf" and a.flags.c_contiguous
        chunks.append(memoryview(a.reshape(-1)).cast("B") if big else a.tobytes())
        offset += a.nbytes
    head = json.dumps(header).encode()
    return [len(head).to_bytes(4, "little") + head, *chunks]


def pack(arrays: dict) -> bytes:
    """pack_parts as one bytes object."""
    return b"".join(pack_parts(arrays))


def _write_parts(path: Path, arrays: dict) -> Path:
    """`arrays` packed into `path`, atomically (a temporary file renamed over it), written part by part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.writelines(pack_parts(arrays))
    os.replace(tmp, path)
    return path


def unpack(blob: bytes) -> dict[str, np.ndarray]:
    n = int.from_bytes(blob[:4], "little")
    header, body = json.loads(blob[4:4 + n]), memoryview(blob)[4 + n:]
    out = {}
    for name, (dtype, shape, offset) in header.items():
        dt = np.dtype(dtype)
        count = int(np.prod(shape)) if shape else 1
        out[name] = np.frombuffer(body, dt, count, offset).reshape(tuple(shape)).copy()
    return out


class CaptureStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.side = self.root / SIDE
        for d in (self.root, self.side / "locks", self.side / "handoff", self.side / "talker"):
            d.mkdir(parents=True, exist_ok=True)
        self._step_paths: dict[str, str] = {}  # request id -> its steps file

    def path(self, tag: str) -> Path:
        return self.root / f"{tag}.npz"

    @contextmanager
    def _locked(self, name: str):
        with open(self.side / "locks" / name, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def update(self, tag: str, *, replace: bool = False, **arrays: np.ndarray) -> Path:
        """Merge `arrays` into `<tag>.npz` (replacing arrays of the same name), atomically.

        `replace`: start the file afresh (a new request reusing a tag drops the old one's arrays)."""
        if not valid_tag(tag):
            raise ValueError(f"not a usable capture tag: {tag!r}")
        path = self.path(tag)
        with self._locked(tag):
            merged: dict[str, np.ndarray] = {}
            if path.exists() and not replace:
                with np.load(path, allow_pickle=False) as z:
                    merged = {k: z[k] for k in z.files}
            merged.update({k: np.asarray(v) for k, v in arrays.items()})
            # difftest's one capture schema, atomically; no fsync: the engine's worker waits on this write,
            # and a file that a power cut loses belongs to a run that is lost with it
            capture.write(path, merged, durable=False)
        return path

    def _talker_path(self, request_id: str) -> Path:
        return self.side / "talker" / f"{hashlib.sha256(request_id.encode()).hexdigest()[:32]}.arrays"

    def file_talker(self, request_id: str, **arrays: np.ndarray) -> Path:
        """The talker's input for a request, filed by id (its worker never sees the tag), atomically."""
        return _write_parts(self._talker_path(request_id), arrays)

    def file_prompt(self, request_id: str, **arrays: np.ndarray) -> Path:
        """The talker's prompt rows for a request (hooks.PromptRows) whose prefill took several
        steps, filed by id beside its input at the last (a prefill in one step files them with the
        input itself)."""
        return _write_parts(self._talker_path(request_id).with_suffix(".prompt"), arrays)

    def take_talker(self, request_ids) -> dict[str, np.ndarray] | None:
        """The talker's input filed under any of these ids, with its prompt rows, used up; None when
        none was. Prompt rows never filed beside an input read `input_prompt_missing`."""
        for rid in request_ids:
            path = self._talker_path(str(rid))
            try:
                arrays = unpack(path.read_bytes())
            except FileNotFoundError:
                continue
            path.unlink(missing_ok=True)
            rows = path.with_suffix(".prompt")
            try:  # a chunked prefill's rows, filed at its last step
                arrays.update(unpack(rows.read_bytes()))
                rows.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            if "input_prompt_embeds" not in arrays and "input_prompt_missing" not in arrays:
                arrays["input_prompt_missing"] = np.array(
                    f"no prompt rows were filed for request {rid} (its prefill did not complete in a step the "
                    f"capture saw)")
            return arrays
        return None

    def _steps_path(self, request_id: str) -> Path:
        return self._talker_path(request_id).with_suffix(".steps")

    def file_steps(self, request_ids, positions, ids: np.ndarray, logprobs: np.ndarray) -> None:
        """Append one step's record per request (rows in `request_ids` order). One writer per file
        (the talker's worker), appends of a few dozen bytes: a reader sees whole records or a
        partial last one, which it drops."""
        rec = np.zeros(len(request_ids), step_dtype(ids.shape[1]))
        rec["pos"], rec["ids"], rec["logprobs"] = positions, ids, logprobs
        for rid, row in zip(request_ids, rec):
            # every step of every request comes here: a remembered path and one O_APPEND write, no pathlib
            path = self._step_paths.get(rid)
            if path is None:
                if len(self._step_paths) >= 4096:
                    self._step_paths.clear()
                path = self._step_paths[rid] = str(self._steps_path(str(rid)))
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, row.tobytes())
            finally:
                os.close(fd)

    def _records(self, request_ids, suffix: str, dt: np.dtype, consume: bool) -> np.ndarray | None:
        """The whole fixed-size records in the `suffix` side file of the first of these ids that has
        one (a partial last record dropped); None when none has. `consume`: the file is used up."""
        for rid in request_ids:
            path = self._talker_path(str(rid)).with_suffix(suffix)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            if consume:
                path.unlink(missing_ok=True)
            return np.frombuffer(data[:len(data) - len(data) % dt.itemsize], dt).copy()
        return None

    def talker_steps(self, request_ids, consume: bool = False) -> np.ndarray | None:
        """The step records filed under the first of these ids that has any; None when none has."""
        return self._records(request_ids, ".steps", step_dtype(), consume)

    SCHEDULE_KINDS = ("prefill", "preempt")

    def file_schedule(self, request_id: str, kind: str, values) -> None:
        """Append one scheduler record for a request (schedule.py): its kind and three integers. One
        writer per file (the talker's engine core), appends of 32 bytes, as file_steps."""
        rec = np.array([self.SCHEDULE_KINDS.index(kind), *[int(v) for v in values], 0, 0, 0][:4], "<i8")
        fd = os.open(str(self._talker_path(str(request_id)).with_suffix(".sched")),
                     os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, rec.tobytes())
        finally:
            os.close(fd)

    def schedule(self, request_ids, consume: bool = False) -> dict[str, np.ndarray]:
        """The scheduler's records for a request, as capture arrays: `talker_prefill` (K, 3) [computed
        before, scheduled, generated] and `talker_preemptions` (P, 2) [generated, computed]; empty
        when the scheduler filed none (a request served in one step, never preempted)."""
        found = self._records(request_ids, ".sched", np.dtype(("<i8", (4,))), consume)
        recs = np.zeros((0, 4), np.int64) if found is None else found.reshape(-1, 4).astype(np.int64)
        return {"talker_prefill": recs[recs[:, 0] == 0, 1:4].copy(),
                "talker_preemptions": recs[recs[:, 0] == 1, 1:3].copy()}

    def file_handoff(self, flat_codes: np.ndarray, tag: str, request_id: str, chunk: int = 0,
                     last: bool = True) -> str:
        """Remember which request, which of its chunks, and whether its last, a payload of codes is; returns its key."""
        key = codes_key(flat_codes)
        line = f"{tag}\t{request_id}\t{int(chunk)}\t{int(bool(last))}\n"
        with self._locked("handoff"):
            with open(self.side / "handoff" / key, "a") as f:
                f.write(line)
        return key

    def take_handoff(self, flat_codes: np.ndarray, request_ids=()) -> tuple[str, int, bool] | None:
        """(tag, chunk index, last chunk?) of the hand-off that carried exactly these codes, or None;
        the entry is used up.

        Identical codes are expected (the same segment at concurrency 1 and N):
        an entry is consumed when the vocoder takes it, and among several the
        one whose request id matches (`rid`, or `rid-<suffix>` for an engine's
        internal id) wins, else the oldest."""
        path = self.side / "handoff" / codes_key(flat_codes)
        ids = [str(r) for r in request_ids if r is not None]
        with self._locked("handoff"):
            try:
                lines = [ln for ln in path.read_text().splitlines() if "\t" in ln]
            except FileNotFoundError:
                return None
            pick = 0
            for i, ln in enumerate(lines):
                rid = ln.split("\t")[1]
                if rid and any(x == rid or x.startswith(rid + "-") for x in ids):
                    pick = i
                    break
            fields = lines.pop(pick).split("\t")
            if lines:
                path.write_text("".join(ln + "\n" for ln in lines))
            else:
                path.unlink()
        chunk = int(fields[2]) if len(fields) > 2 else 0
        last = fields[3] != "0" if len(fields) > 3 else True
        return fields[0], chunk, last
