"""The offline runner's `generate` job (docs/runner-protocol.md), in waves.

A wave is what the tester wants decoded together (`waves`, lists of segment
ids; default: consecutive runs of `concurrency` segments). Within a wave the
segments are split by checkpoint type (one engine each) and, with the `Omni`
batch API, by the stage-0 sampling settings one `Omni.generate` call must share
(prompts.sampling_key); each part is one batch, recorded in every member's
result (`meta.batch`). With `AsyncOmni` a wave is split by checkpoint type only. The answers' float32 audio is the result's waveform;
the codes come from the capture plugin, which this runner's environment asks
to name files after request ids (`DIFFTEST_CAPTURE_UNTAGGED=request-id`).

Everything is checked before a model starts; a segment already in `out_dir`
is answered from there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from difftest.engines import capture
from difftest.engines.capture import Capture, CaptureError
from difftest.family import CODEBOOKS
from difftest.results import CorruptResult, Result, ResultStore, reusable_together, write_result
from runners.reference.checkpoint import MODEL_TYPE_OF_TASK, Checkpoint
from runners.reference.environment import log
from runners.reference.service import BadInput, parse_segment
from runners.vllm_omni_offline import LABEL, prompts
from runners.vllm_omni_offline.engine import OmniPool

CAPTURE_WAIT_S = 30.0  # the vocoder's side of a capture may land a moment after the answer (longer when busy)


class OfflineService:
    def __init__(self, checkpoints: dict[str, Checkpoint], pool: OmniPool, provenance: dict):
        self.checkpoints = checkpoints
        self.pool = pool
        self.provenance = provenance
        self.capture_dir = Path(os.environ["DIFFTEST_CAPTURE_DIR"]) if os.environ.get("DIFFTEST_CAPTURE_DIR") else None
        self.identity = None  # the job's: what the tester says produced its results (difftest.engines.identity)

    def generate(self, job: dict, emit) -> None:
        segments = [s for s in job.get("segments") or [] if isinstance(s, dict)]
        by_id = {s.get("id"): s for s in segments}
        concurrency = int(job.get("concurrency") or 1)
        out_dir = job.get("out_dir")
        if not out_dir or concurrency < 1:
            for sid in by_id:
                emit("error", segment=sid, kind="bad_input",
                     message="generate job needs out_dir and a concurrency of at least 1")
            return
        out_dir = Path(out_dir)
        self.identity = job.get("identity")
        waves = job.get("waves") or [[s.get("id") for s in segments[i:i + concurrency]]
                                     for i in range(0, len(segments), concurrency)]
        listed = {sid for wave in waves for sid in wave}
        for sid in by_id:
            if sid not in listed:
                emit("error", segment=sid, kind="bad_input", message="segment is in no wave")
        for wave in waves:
            self._wave([by_id[sid] for sid in wave if sid in by_id], out_dir, concurrency, emit)

    def _wave(self, segs: list[dict], out_dir: Path, concurrency: int, emit) -> None:
        store = ResultStore(out_dir)
        found = {}
        for seg in segs:
            sid, h = seg.get("id"), seg.get("hash")
            cached = store.get(out_dir, sid, h) if isinstance(sid, str) and isinstance(h, str) else None
            if cached is not None and cached.meta.get("identity") == self.identity:
                found[sid] = cached
        reused = reusable_together(found)  # a batch whose member changed is decoded again, whole
        groups: dict[tuple, list] = {}
        for seg in segs:
            sid = seg.get("id", "?")
            try:
                if not isinstance(sid, str) or not isinstance(seg.get("hash"), str):
                    raise BadInput("a segment needs an id and its content hash")
                cached = reused.get(sid)
                if cached is not None:
                    emit("result", segment=sid, path=str(cached.source), cached=True,
                         seconds=float(cached.timings.get("seconds", 0.0)), audio_seconds=cached.seconds)
                    continue
                utt, voice = parse_segment(seg, self.checkpoints)
                ref = prompts.read_voice(utt.voice_wav) if utt.voice_wav else None
            except (BadInput, ValueError, OSError) as e:
                emit("error", segment=sid, kind="bad_input", message=str(e))
                continue
            # Omni.generate shares its SamplingParams across a call; AsyncOmni takes them per request
            key = (utt.task, prompts.sampling_key(utt.decode) if self.pool.api == "batch" else None)
            groups.setdefault(key, []).append((seg, utt, voice, ref))
        for (task, _), members in groups.items():
            self._batch(task, members, out_dir, concurrency, emit)

    def _batch(self, task: str, members: list, out_dir: Path, concurrency: int, emit) -> None:
        ids = [seg["id"] for seg, *_ in members]
        try:
            if not self.pool.is_started(task):
                emit("progress", segment=ids[0], stage="load",
                     message=f"starting vLLM-Omni (offline) for the {MODEL_TYPE_OF_TASK[task]} checkpoint")
            self.pool.omni(task)  # started here, so the batch's seconds are the batch's
            batch = []
            for seg, utt, voice, ref in members:
                info = prompts.additional_information(utt, ref)
                batch.append(prompts.prompt(info, self.pool.prompt_len(task, info)))
            t0 = time.perf_counter()
            sampling = [prompts.sampling_fields(prompts.sampling_key(utt.decode)) for _, utt, _, _ in members]
            answers = self.pool.generate(task, batch, sampling)
            seconds = time.perf_counter() - t0
        except Exception as e:  # vLLM-Omni failed this batch: every member's error, the next batch goes on
            log(f"batch {ids}: {type(e).__name__}: {e}")
            for sid in ids:
                emit("error", segment=sid, kind="engine", message=f"vLLM-Omni offline: {type(e).__name__}: {e}")
            return
        for (seg, utt, voice, _), ans in zip(members, answers):
            try:
                path, audio_s = self._write(seg, utt, voice, ans, ids, seconds, out_dir, concurrency, task)
            except (CorruptResult, CaptureError, ValueError, OSError) as e:
                emit("error", segment=seg["id"], kind="capture" if isinstance(e, capture.CaptureMissing) else "engine",
                     message=str(e), **(capture.defect_of(e) if isinstance(e, CaptureError) else {}))
                continue
            emit("result", segment=seg["id"], path=str(path), cached=False, seconds=seconds, audio_seconds=audio_s)

    def _capture(self, request_id: str, max_frames: int | None = None) -> Capture | None:
        """The request's checked capture (None when capture is off). CaptureError when it was asked
        for and is missing or unusable: the segment's error, never a silent audio-only result."""
        if self.capture_dir is None:
            return None
        from difftest_capture import request_id_tag

        path = self.capture_dir / f"{request_id_tag(request_id)}.npz"
        deadline = time.monotonic() + CAPTURE_WAIT_S
        while True:  # the talker's and the vocoder's sides land separately
            if path.exists():
                try:
                    cap = capture.load(path, max_frames)
                    if cap.wav is not None:
                        return cap
                except CaptureError:
                    if time.monotonic() >= deadline:
                        raise
            if time.monotonic() >= deadline:
                raise capture.CaptureMissing(f"{path}: no complete capture (codes and wav) for request "
                                             f"{request_id} within {CAPTURE_WAIT_S:.0f} s of its answer")
            time.sleep(0.05)

    def _write(self, seg, utt, voice, ans, batch_ids, seconds, out_dir, concurrency, task):
        cap = self._capture(ans.request_id, utt.decode.get("max_new_tokens"))
        empty = np.zeros((0, CODEBOOKS), np.int64)
        ckpt = self.checkpoints[task]
        extra = {"capture_wav": cap.wav, **cap.stage_arrays()} if cap is not None else {}
        result = Result(
            segment_id=seg["id"], segment_hash=seg["hash"], wav=ans.wav, sample_rate=ans.sample_rate,
            codes=cap.codes if cap is not None else empty,
            ref_codes=cap.ref_codes if cap is not None else empty,
            has_codes=cap is not None, quantised=False,
            provenance={**self.provenance, "task": task, "voice": voice, "decode": dict(utt.decode),
                        "checkpoint": {"path": str(ckpt.path), "model": ckpt.spec, "sha256": ckpt.sha256}},
            timings={"batch_seconds": round(seconds, 4), "seconds": round(seconds, 4),
                     **({"engine_start_s": self.pool.start_seconds[ckpt.model_type]}
                        if ckpt.model_type in self.pool.start_seconds else {})},
            meta={"runner": LABEL, "concurrency": concurrency, "batch": batch_ids, "request_id": ans.request_id,
                  "capture": cap is not None, "identity": self.identity,
                  **(capture.schedule_meta(cap.schedule) if cap is not None else {})},
            extra=extra)
        side = write_result(ResultStore.stem(out_dir, seg["id"], seg["hash"]), result)
        return side, len(ans.wav) / ans.sample_rate
