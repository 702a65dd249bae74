"""Capture files (docs/architecture.md, contract 5): the one schema, its writer and its reader.

An engine started with `DIFFTEST_CAPTURE_DIR=<dir>` writes, per tagged request,
`<dir>/<tag>.npz` (no pickles). Every writer (the vLLM-Omni capture plugin, the CPU
test engine) writes through `encode`/`write` here, and the tester reads through
`load`; numpy only, so the plugin imports it inside vLLM's processes. Schema
version 2 (`schema_version`, an integer scalar; a file without it is read as 1,
which lacks the talker's arrays):

| array          | shape / type           | meaning                                               |
|----------------|------------------------|-------------------------------------------------------|
| `codes`        | (T, 16) integers       | the generated codes the vocoder got (reference prefix |
|                |                        | excluded), each in [0, 2048)                          |
| `ref_codes`    | (R, 16) integers       | the reference prefix the vocoder got (R may be 0;     |
|                |                        | absent means 0)                                       |
| `wav`          | (S,) floats            | the vocoder's output before 16-bit quantisation       |
| `sample_rate`  | integer scalar         | of `wav` (24000)                                      |
| `lead_samples` | integer scalar, 0 or 1 | samples before the first generated frame: qwen-tts's  |
|                |                        | proportional cut can leave one (difftest.compare.align) |
| `talker_ref_codes` | (R', 16) integers  | the talker's input: the reference codes its prompt was |
|                |                        | built from, as the engine's encoder made them (v2)    |
| `talker_prompt` | 3 integers            | prompt positions the engine reserved, prompt rows it  |
|                |                        | built, its ref_code_len (-1: none) (v2)               |
| `talker_tokens` | (T',) integers >= 0   | the talker's output: the codebook-0 tokens it sampled, |
|                |                        | the final one (EOS, or the last under a length cap)   |
|                |                        | never becomes a frame (v2)                            |
| `talker_topk_ids`, | (T', k) integers,  | optional: the talker's own top-k tokens and their     |
| `talker_topk_logprobs` | (T', k) floats | log-probabilities at each token's step, best first    |
|                |                        | (k >= 2; 0 rows: not captured)                        |

Schema version 3 adds the talker's input, what its prompt is made of, per request, before the
embeddings are summed (all together or none; `input_missing`, a string, when the writer tried and
could not):

| array                     | shape / type       | meaning                                          |
|---------------------------|--------------------|--------------------------------------------------|
| `input_text_ids`          | (L,) integers      | the assistant text's token ids, chat template in (Qwen3-Omni: the chat turn the thinker read) |
| `input_instruct_ids`      | (L',) integers     | the instruction's token ids (0: none)            |
| `input_ref_text_ids`      | (L'',) integers    | an in-context clone's reference text ids (0: none) |
| `input_ref_codes`         | (R, 16) integers   | the reference codes its prompt holds (0 rows: none) |
| `input_codec_prefill`     | (3 or 4,) integers | think / no-think, think-bos, language id, think-eos |
| `input_speaker_id`        | (0 or 1,) integers | a custom voice's speaker id (Qwen3-Omni: the talker's speaker) |
| `input_speaker_embedding` | (H,) floats        | a clone's speaker embedding as the talker got it (0: none) |
| `input_speaker_dtype`     | string             | the dtype that embedding had                     |
| `input_non_streaming`     | integer, 0 or 1    | the prompt's layout: the whole text first (1)    |

Optional beside them (issue 57, item 5: the prompt assembled, not only its ingredients), together
or not at all (absent: not captured, as in older captures):

| array                     | shape / type       | meaning                                          |
|---------------------------|--------------------|--------------------------------------------------|
| `input_prompt_embeds`     | (L, H) float32     | the talker's prompt rows as it received them:    |
|                           |                    | after assembly, before its first step, without a |
|                           |                    | batch's padding rows; finite, at most            |
|                           |                    | MAX_PROMPT_ROWS x MAX_PROMPT_HIDDEN              |
| `input_prompt_dtype`      | string             | the dtype those rows had (`float32`, `bfloat16`, |
|                           |                    | `float16`), as `input_speaker_dtype`             |
| `input_prompt_rows`       | (L,) integers      | optional: which ingredient each row holds, an    |
|                           |                    | index into PROMPT_ROWS (the reference runner     |
|                           |                    | writes it from qwen-tts's layout)                |
| `input_prompt_cached`     | integer in [0, L]  | optional: leading rows the talker's forward never |
|                           |                    | got (a prefix-cache hit), taken from the prompt  |
|                           |                    | built in the same step                           |

A writer that tried and could not read the rows writes `input_prompt_missing` (a string) instead:
the capture is then an error, as with `input_missing`.

The three talker arrays come together or not at all: the stage before the
hand-off, so the tester can tell what the hand-off changed (a reference prefix
that is not the talker's own, a frame lost) from what the talker was given. A
writer that tried and failed writes `talker_missing` (a string saying why)
instead: the capture is then an error, not a quieter judgement.

Two more tell how the vocoder got the codes, read where present (a run configured to chunk
must show it did, difftest.verdicts.exercised):

| `handoff`      | string            | "full_payload" (one hand-off) or "async_chunk" |
| `chunk_frames` | (K,) integers     | frames of each hand-off, in order              |

A writer may add arrays of its own; the reader keeps to these.

The file comes from the engine under test, so nothing in it is trusted: a
file that breaks these rules is a `CaptureError`, which the caller turns into
that segment's candidate error. It never crashes a run, and values are never
cast silently (uint64 codes that do not fit, floats, codes outside the
codebook).
"""

from __future__ import annotations

import io
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..family import CODEBOOK_SIZE, CODEBOOKS  # the talker's specials (>= CODEBOOK_SIZE) never reach the vocoder

MAX_BYTES = 256 << 20  # about 100 minutes of float32 audio with its codes: far beyond any segment
# Compressed or not, the arrays a capture holds may not unpack to more than this (a zip of zeros
# claiming millions of frames is refused from its headers, before any of it is read).
MAX_UNPACKED = MAX_BYTES
MAX_LEAD_SAMPLES = 1
SCHEMA_VERSION = 3
READS = (1, 2, 3)  # version 1: no talker arrays; 2: no talker input
TALKER = ("talker_ref_codes", "talker_prompt", "talker_tokens")
TOPK = ("talker_topk_ids", "talker_topk_logprobs")
INPUT_IDS = ("input_text_ids", "input_instruct_ids", "input_ref_text_ids", "input_codec_prefill", "input_speaker_id")
INPUT = (*INPUT_IDS, "input_ref_codes", "input_speaker_embedding", "input_speaker_dtype", "input_non_streaming")


def chat_turn_inputs(text_ids, codec_prefill, speaker_id: int) -> dict:
    """The `input_*` arrays of a Qwen3-Omni talker's prompt (both sides build it here): the chat turn
    as the thinker read it (`input_text_ids`), the codec prefill its assistant part opens with (no-think,
    think-bos, think-eos) and the speaker id it was built with; nothing of a clone or an instruction.
    The thinker's answer is not an input here: it is numerics' (a bf16 thinker may answer otherwise)."""
    ids = lambda a: np.asarray(a, np.int64).reshape(-1)
    empty = np.zeros(0, np.int64)
    return {"input_text_ids": ids(text_ids), "input_instruct_ids": empty, "input_ref_text_ids": empty,
            "input_codec_prefill": ids(codec_prefill), "input_speaker_id": ids([speaker_id]),
            "input_ref_codes": np.zeros((0, CODEBOOKS), np.int64), "input_speaker_embedding": np.zeros(0, np.float32),
            "input_speaker_dtype": np.array(""), "input_non_streaming": np.array(0, np.int64)}


# The assembled prompt (optional within the input): its rows, their dtype, and (the reference's) row labels.
PROMPT = ("input_prompt_embeds", "input_prompt_dtype")
PROMPT_LABELS = "input_prompt_rows"
PROMPT_CACHED = "input_prompt_cached"
PROMPT_DTYPES = ("float32", "bfloat16", "float16")
MAX_PROMPT_ROWS = 1 << 15
MAX_PROMPT_HIDDEN = 1 << 14
MAX_PROMPT_VALUES = 1 << 24  # 64 MiB of float32: 8192 rows of the 1.7B talker's 2048
# What each row of qwen-tts's assembled talker prompt holds (Qwen3TTSForConditionalGeneration.generate,
# qwen-tts 0.1.1), in its order: an instruction block; the assistant header ("<|im_start|>assistant\n");
# the codec prefill (think / no-think, think-bos, language, think-eos) over the text pad; a speaker (a
# custom voice's id, a clone's x-vector) over the text pad; the codec pad over the text's bos; then the
# text. A row "A + B" holds both (streaming: a text token over a codec bos or a reference frame);
# `text`, `text eos` and `reference text` rows hold the codec pad, `codec bos` and `reference codes` rows
# the text pad. "unknown": a layout runners/reference/prompt_inputs.py could not label (never guessed).
PROMPT_ROWS = ("unknown", "instruction", "role", "codec prefill", "speaker", "codec pad", "codec bos",
               "text", "text eos", "reference text", "reference codes", "text + codec bos",
               "text eos + codec bos", "reference text + codec bos", "reference text + reference codes",
               "text + reference codes", "text eos + reference codes")
KNOWN = ("codes", "ref_codes", "wav", "sample_rate", "lead_samples", "schema_version", *TALKER, *TOPK, *INPUT,
         *PROMPT, PROMPT_LABELS, PROMPT_CACHED)


class CaptureError(ValueError):
    """A capture file the tester cannot use; the message names the file and the problem."""


class CaptureMissing(CaptureError):
    """A capture that was asked for and never written."""


class OverLength(CaptureError):
    """More generated than the request's max_new_tokens allows: the engine did not apply a field of
    the request, a defect judged where the request is mapped to the talker (`talker_input`), not an
    error. The file is still refused (its arrays are not kept: a runaway engine's are unbounded)."""

    verdict, stage = "talker_defect", "talker_input"


@dataclass(frozen=True)
class Capture:
    codes: np.ndarray  # (T, 16) int64
    ref_codes: np.ndarray  # (R, 16) int64
    wav: np.ndarray | None  # float32, before quantisation
    sample_rate: int | None
    lead_samples: int
    path: Path
    talker_ref_codes: np.ndarray | None = None  # (R', 16): what the talker was prompted with; None: not captured
    talker_prompt: np.ndarray | None = None  # [reserved, built, ref_code_len]
    talker_tokens: np.ndarray | None = None  # codebook-0 tokens the talker sampled
    talker_topk_ids: np.ndarray | None = None  # (len(talker_tokens), k): the talker's own top-k; None: not captured
    talker_topk_logprobs: np.ndarray | None = None
    inputs: dict | None = None  # the talker's input (v3: INPUT's arrays); None: not captured
    handoff: str | None = None  # "full_payload" or "async_chunk"; None: not said
    chunk_frames: np.ndarray | None = None  # frames per hand-off; None: not said
    schedule: dict | None = None  # {"prefill": (K, 3), "preemptions": (P, 2)}; None: not said

    def stage_arrays(self) -> dict[str, np.ndarray]:
        """The talker stage's arrays, for a result's extra arrays (empty when not captured)."""
        out = dict(self.inputs or {})
        if self.talker_tokens is None:
            return out
        out |= {"talker_ref_codes": self.talker_ref_codes, "talker_prompt": self.talker_prompt,
                "talker_tokens": self.talker_tokens}
        if self.talker_topk_ids is not None:
            out |= {"talker_topk_ids": self.talker_topk_ids, "talker_topk_logprobs": self.talker_topk_logprobs}
        return out


def _codes(arrays: dict, name: str, where: Path, required: bool) -> np.ndarray:
    if name not in arrays:
        if required:
            raise CaptureError(f"{where}: no {name!r} array")
        return np.zeros((0, CODEBOOKS), np.int64)
    a = arrays[name]
    if a.dtype.kind not in "iu":
        raise CaptureError(f"{where}: {name} holds {a.dtype} values, expected integers")
    if a.size == 0:
        return np.zeros((0, CODEBOOKS), np.int64)
    if a.ndim != 2 or a.shape[1] != CODEBOOKS:
        raise CaptureError(f"{where}: {name} has shape {a.shape}, expected (frames, {CODEBOOKS})")
    # Compared in the array's own dtype: a uint64 beyond int64 must not wrap to a negative number.
    bad = (a < 0) | (a >= CODEBOOK_SIZE)
    if bad.any():
        f, c = (int(i) for i in np.argwhere(bad)[0])
        raise CaptureError(f"{where}: {name}[{f}, {c}] = {a[f, c]} lies outside the codebook [0, {CODEBOOK_SIZE})")
    return a.astype(np.int64)


def _scalar(arrays: dict, name: str, where: Path) -> int | None:
    if name not in arrays:
        return None
    a = arrays[name]
    if a.size != 1 or a.dtype.kind not in "iu":
        raise CaptureError(f"{where}: {name} must be one integer, got {a.dtype} of shape {a.shape}")
    return int(a.reshape(-1)[0])


def validate(arrays: dict, where: Path, max_frames: int | None = None) -> Capture:
    """The checked content of one capture file's arrays; `max_frames`: the request's max_new_tokens
    (more generated frames than the request allowed is the engine's error, before any scoring)."""
    version = _scalar(arrays, "schema_version", where)
    if version is not None and version not in READS:
        raise CaptureError(f"{where}: capture schema version {version}; this difftest reads versions "
                           f"{', '.join(map(str, READS))} (the engine's capture plugin and difftest come from "
                           f"different checkouts?)")
    codes = _codes(arrays, "codes", where, required=True)
    ref_codes = _codes(arrays, "ref_codes", where, required=False)
    talker = _talker(arrays, where, max_frames)
    if max_frames is not None:
        # A hand-off that leaves the reference in the vocoder's stream (#4421) adds up to its length:
        # that is a defect to diagnose, not a capture to refuse.
        prefix = max(len(ref_codes) if ref_codes is not None else 0,
                     len(talker[0]) if talker[0] is not None else 0)
        if len(codes) > max_frames + prefix:
            plus = f" plus its {prefix}-frame reference" if prefix else ""
            raise OverLength(f"{where}: {len(codes)} frames, more than the request's max_new_tokens "
                               f"({max_frames}){plus} allows: the engine did not apply the request's max_new_tokens")
    wav = None
    if "wav" in arrays:
        w = arrays["wav"]
        if w.dtype.kind != "f":
            raise CaptureError(f"{where}: wav holds {w.dtype} values, expected floats")
        if w.ndim != 1 and not (w.ndim == 2 and 1 in w.shape):
            raise CaptureError(f"{where}: wav has shape {w.shape}, expected mono samples")
        wav = w.astype(np.float32).reshape(-1)  # its length is the comparison's business (length_mismatch)
        bad = np.flatnonzero(~np.isfinite(wav))
        if len(bad):
            raise CaptureError(f"{where}: wav sample {int(bad[0])} is {wav[bad[0]]} ({len(bad)} samples "
                               f"not finite): the vocoder's output is broken")
    rate = _scalar(arrays, "sample_rate", where)
    if rate is not None and rate <= 0:
        raise CaptureError(f"{where}: sample_rate {rate} is not positive")
    lead = _scalar(arrays, "lead_samples", where) or 0
    if not 0 <= lead <= MAX_LEAD_SAMPLES:
        raise CaptureError(f"{where}: lead_samples {lead} outside [0, {MAX_LEAD_SAMPLES}]")
    handoff, chunks = _handoff(arrays, where)
    return Capture(codes, ref_codes, wav, rate, lead, where, *talker, inputs=read_inputs(arrays, where),
                   handoff=handoff, chunk_frames=chunks, schedule=_schedule(arrays, where))


SCHEDULE = {"talker_prefill": 3, "talker_preemptions": 2}  # name -> columns


def _schedule(arrays: dict, where) -> dict | None:
    present = [n for n in SCHEDULE if n in arrays]
    if not present:
        return None
    if len(present) != len(SCHEDULE):
        raise CaptureError(f"{where}: talker_prefill and talker_preemptions come together")
    out = {}
    for name, cols in SCHEDULE.items():
        a = arrays[name]
        if a.size == 0:
            a = np.zeros((0, cols), np.int64)
        if a.dtype.kind not in "iu" or a.ndim != 2 or a.shape[1] != cols or (a < 0).any():
            raise CaptureError(f"{where}: {name} must be ({'K' if cols == 3 else 'P'}, {cols}) integers >= 0, got "
                               f"{a.dtype} of shape {a.shape}")
        out[name.removeprefix("talker_")] = a.astype(np.int64)
    return out


def schedule_meta(schedule: dict | None) -> dict:
    """What a result's meta says of the talker's scheduling (exercised.py reads it): its prompt's
    prefill steps, and the tokens generated at each preemption."""
    if schedule is None:
        return {}
    pre = schedule["prefill"]
    # a step inside the prompt: computed-before below the first record past it (a resume's replay starts at 0 again)
    in_prompt = [int(n) for before, n, generated in pre if generated == 0]
    return {"prefill_steps": len(in_prompt), "prefill_tokens": in_prompt,
            "preempted_at": [int(g) for g, _ in schedule["preemptions"]],
            "resume_steps": [[int(b), int(n), int(g)] for b, n, g in pre if g > 0]}


def defect_of(e: CaptureError) -> dict:
    """The fields that make a refused capture a segment's defect verdict (OverLength), else {}."""
    return {"defect": e.verdict, "stage": e.stage} if isinstance(e, OverLength) else {}


HANDOFFS = ("full_payload", "async_chunk")


def _handoff(arrays: dict, where) -> tuple[str | None, np.ndarray | None]:
    handoff = chunks = None
    if "handoff" in arrays:
        a = arrays["handoff"]
        if a.dtype.kind != "U" or a.size != 1 or str(a.reshape(-1)[0]) not in HANDOFFS:
            raise CaptureError(f"{where}: handoff must be one of {', '.join(HANDOFFS)}, got {a.dtype} {a!r}"[:300])
        handoff = str(a.reshape(-1)[0])
    if "chunk_frames" in arrays:
        c = arrays["chunk_frames"]
        if c.dtype.kind not in "iu" or c.ndim != 1 or not len(c) or (c < 0).any():
            raise CaptureError(f"{where}: chunk_frames must be a non-empty row of integers >= 0, got {c.dtype} "
                               f"of shape {c.shape}")
        chunks = c.astype(np.int64)
    return handoff, chunks


def read_inputs(arrays: dict, where) -> dict | None:
    """The talker's input (schema v3), checked, or None where it was not captured. Also reads a
    result's extra arrays (the reference runner writes the same fields)."""
    if "input_missing" in arrays:
        raise CaptureError(f"{where}: the talker's input was not captured ({arrays['input_missing']})")
    if "input_prompt_missing" in arrays:
        raise CaptureError(f"{where}: the talker's assembled prompt was not captured "
                           f"({arrays['input_prompt_missing']})"[:1000])
    present = [n for n in INPUT if n in arrays]
    if not present:
        if any(n in arrays for n in (*PROMPT, PROMPT_LABELS, PROMPT_CACHED)):
            raise CaptureError(f"{where}: input_prompt_* without the input_* arrays they come with")
        return None
    if len(present) != len(INPUT):
        raise CaptureError(f"{where}: the input_* arrays come together; {', '.join(sorted(set(INPUT) - set(present)))} missing")
    out = {}
    for name in INPUT_IDS:
        a = arrays[name]
        if a.dtype.kind not in "iu" or a.ndim != 1 or (a < 0).any():
            raise CaptureError(f"{where}: {name} must be a row of integers >= 0, got {a.dtype} of shape {a.shape}")
        out[name] = a.astype(np.int64)
    if not len(out["input_text_ids"]) or len(out["input_codec_prefill"]) not in (3, 4) or len(out["input_speaker_id"]) > 1:
        raise CaptureError(f"{where}: input_text_ids must not be empty, input_codec_prefill must hold 3 or 4 ids "
                           f"and input_speaker_id at most one")
    if arrays["input_ref_codes"].size == 0:  # an empty (0, 16) or (0,) array: no reference in the prompt
        out["input_ref_codes"] = np.zeros((0, CODEBOOKS), np.int64)
    else:
        out["input_ref_codes"] = _codes(arrays, "input_ref_codes", where, required=True)
    emb = arrays["input_speaker_embedding"]
    if emb.dtype.kind != "f" or emb.ndim != 1 or not np.isfinite(emb).all():
        raise CaptureError(f"{where}: input_speaker_embedding must be a row of finite floats, got {emb.dtype} "
                           f"of shape {emb.shape}")
    out["input_speaker_embedding"] = emb.astype(np.float32)
    dt = arrays["input_speaker_dtype"]
    if dt.dtype.kind != "U" or dt.size != 1:
        raise CaptureError(f"{where}: input_speaker_dtype must be one string")
    out["input_speaker_dtype"] = np.array(str(dt.reshape(-1)[0]))
    ns = _scalar(arrays, "input_non_streaming", where)
    if ns not in (0, 1):
        raise CaptureError(f"{where}: input_non_streaming must be 0 or 1, got {ns}")
    out["input_non_streaming"] = np.array(ns, np.int64)
    return out | read_prompt(arrays, where)


def read_prompt(arrays: dict, where) -> dict:
    """The talker's assembled prompt (input_prompt_*), checked; {} where it was not captured."""
    present = [n for n in PROMPT if n in arrays]
    if not present:
        if PROMPT_LABELS in arrays or PROMPT_CACHED in arrays:
            raise CaptureError(f"{where}: {PROMPT_LABELS if PROMPT_LABELS in arrays else PROMPT_CACHED} without "
                               f"input_prompt_embeds")
        return {}
    if len(present) != len(PROMPT):
        raise CaptureError(f"{where}: input_prompt_embeds and input_prompt_dtype come together; "
                           f"{', '.join(sorted(set(PROMPT) - set(present)))} missing")
    emb = arrays["input_prompt_embeds"]
    if emb.dtype != np.float32 or emb.ndim != 2 or not emb.shape[0] or not emb.shape[1]:
        raise CaptureError(f"{where}: input_prompt_embeds must be float32 (rows, hidden), got {emb.dtype} "
                           f"of shape {emb.shape}")
    if emb.shape[0] > MAX_PROMPT_ROWS or emb.shape[1] > MAX_PROMPT_HIDDEN or emb.size > MAX_PROMPT_VALUES:
        raise CaptureError(f"{where}: input_prompt_embeds has shape {emb.shape}, more than a talker prompt may "
                           f"hold ({MAX_PROMPT_ROWS} rows, {MAX_PROMPT_HIDDEN} columns, {MAX_PROMPT_VALUES} values)")
    bad = np.argwhere(~np.isfinite(emb))
    if len(bad):
        r, c = (int(i) for i in bad[0])
        raise CaptureError(f"{where}: input_prompt_embeds[{r}, {c}] is {emb[r, c]} ({len(bad)} values not finite)")
    dt = arrays["input_prompt_dtype"]
    if dt.dtype.kind != "U" or dt.size != 1 or str(dt.reshape(-1)[0]) not in PROMPT_DTYPES:
        raise CaptureError(f"{where}: input_prompt_dtype must be one of {', '.join(PROMPT_DTYPES)}, got "
                           f"{dt.dtype} {dt!r}"[:300])
    out = {"input_prompt_embeds": emb, "input_prompt_dtype": np.array(str(dt.reshape(-1)[0]))}
    if PROMPT_LABELS in arrays:
        rows = arrays[PROMPT_LABELS]
        if (rows.dtype.kind not in "iu" or rows.shape != (emb.shape[0],) or (rows < 0).any()
                or (rows >= len(PROMPT_ROWS)).any()):
            raise CaptureError(f"{where}: {PROMPT_LABELS} must hold one index into PROMPT_ROWS "
                               f"[0, {len(PROMPT_ROWS)}) per prompt row ({emb.shape[0]}), got {rows.dtype} "
                               f"of shape {rows.shape}")
        out[PROMPT_LABELS] = rows.astype(np.int64)
    cached = _scalar(arrays, PROMPT_CACHED, where)
    if cached is not None:
        if not 0 <= cached <= emb.shape[0]:
            raise CaptureError(f"{where}: {PROMPT_CACHED} {cached} outside [0, {emb.shape[0]}] (the prompt's rows)")
        out[PROMPT_CACHED] = np.array(cached, np.int64)
    return out


def _talker(arrays: dict, where: Path, max_frames: int | None) -> tuple:
    if "talker_missing" in arrays:  # the writer tried and could not: the capture is incomplete
        raise CaptureError(f"{where}: the talker stage was not captured ({arrays['talker_missing']})")
    present = [n for n in TALKER if n in arrays]
    if not present:
        if any(n in arrays for n in TOPK):
            raise CaptureError(f"{where}: talker_topk_* without the talker's tokens")
        return None, None, None, None, None
    if len(present) != len(TALKER):
        missing = sorted(set(TALKER) - set(present))
        raise CaptureError(f"{where}: talker arrays come together; {', '.join(missing)} missing")
    ref = _codes(arrays, "talker_ref_codes", where, required=True)
    prompt, tokens = arrays["talker_prompt"], arrays["talker_tokens"]
    if prompt.dtype.kind not in "iu" or prompt.shape != (3,):
        raise CaptureError(f"{where}: talker_prompt must be 3 integers, got {prompt.dtype} of shape {prompt.shape}")
    if tokens.dtype.kind not in "iu" or tokens.ndim != 1:
        raise CaptureError(f"{where}: talker_tokens must be a row of integers, got {tokens.dtype} of shape {tokens.shape}")
    if (tokens < 0).any() or (prompt[:2] < 0).any():
        raise CaptureError(f"{where}: talker_tokens / talker_prompt hold negative numbers")
    if max_frames is not None and len(tokens) > max_frames + 1:  # + the final token that never becomes a frame
        raise OverLength(f"{where}: {len(tokens)} talker tokens, more than the request's max_new_tokens "
                           f"({max_frames}) allows: the engine did not apply the request's max_new_tokens")
    return (ref, prompt.astype(np.int64), tokens.astype(np.int64), *_topk(arrays, where, len(tokens)))


def _topk(arrays: dict, where: Path, n_tokens: int) -> tuple:
    """The talker's own top-k per token, checked: as many rows as tokens, ids >= 0, log-probabilities
    finite, <= 0 and best first. Zero rows (the writer could not line them up) read as absent."""
    present = [n for n in TOPK if n in arrays]
    if not present:
        return None, None
    if len(present) != len(TOPK):
        raise CaptureError(f"{where}: talker_topk_ids and talker_topk_logprobs come together")
    ids, lp = arrays["talker_topk_ids"], arrays["talker_topk_logprobs"]
    if ids.dtype.kind not in "iu" or lp.dtype.kind != "f" or ids.ndim != 2 or ids.shape != lp.shape:
        raise CaptureError(f"{where}: talker_topk_ids ({ids.dtype} {ids.shape}) and talker_topk_logprobs "
                           f"({lp.dtype} {lp.shape}) must be integer and float arrays of one (tokens, k) shape")
    if ids.shape[0] == 0:
        return None, None
    if ids.shape[0] != n_tokens or ids.shape[1] < 2:
        raise CaptureError(f"{where}: talker_topk_* have shape {ids.shape}, expected ({n_tokens}, k >= 2): "
                           f"one row per talker token")
    if (ids < 0).any() or not np.isfinite(lp).all() or (lp > 1e-4).any() or (np.diff(lp, axis=1) > 1e-6).any():
        raise CaptureError(f"{where}: talker_topk_* must hold ids >= 0 and finite log-probabilities <= 0, best first")
    return ids.astype(np.int64), lp.astype(np.float32)


def member_sizes(source, where) -> dict[str, int]:
    """Bytes each array of an npz (a path or a file object) unpacks to, read from the archive's
    headers without unpacking anything; CaptureError when a member claims more than MAX_UNPACKED,
    alone or together, or is not a plain array. Call before np.load: a small file may claim
    gigabytes."""
    sizes, total = {}, 0
    try:
        with zipfile.ZipFile(source) as zf:
            for info in zf.infolist():
                if info.file_size > MAX_UNPACKED + 4096:  # the zip's own claim, before the array header's
                    raise CaptureError(f"{where}: member {info.filename} unpacks to {info.file_size} bytes, "
                                       f"more than the {MAX_UNPACKED >> 20} MiB a capture may hold")
                with zf.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                              else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = header(f)
                if dtype.hasobject:
                    raise CaptureError(f"{where}: member {info.filename} holds Python objects")
                n = int(np.prod(shape, dtype=object)) * dtype.itemsize
                total += n
                if total > MAX_UNPACKED:
                    raise CaptureError(f"{where}: member {info.filename} claims shape {shape} of {dtype}: "
                                       f"{total} bytes in all, more than the {MAX_UNPACKED >> 20} MiB a "
                                       f"capture may hold")
                sizes[info.filename.removesuffix(".npy")] = n
    except CaptureError:
        raise
    except Exception as e:  # not a zip, a truncated one, a member that is not an array
        raise CaptureError(f"{where}: unreadable capture ({type(e).__name__}: {e})") from None
    return sizes


def load(path: Path, max_frames: int | None = None) -> Capture:
    """Read and check one capture file (`max_frames`: the request's max_new_tokens, see validate).
    Memory stays bounded: the archive's headers are checked before any array is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CaptureError(f"{path}: cannot read ({e.strerror})") from None
    if size > MAX_BYTES:
        raise CaptureError(f"{path}: {size} bytes, more than the {MAX_BYTES >> 20} MiB a capture may hold")
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            single = f.read(6) == b"\x93NUMPY"
        raise CaptureError(f"{path}: a single array, not an npz archive of named arrays" if single
                           else f"{path}: unreadable capture (not a zip archive, as an npz is)")
    member_sizes(path, path)
    try:
        z = np.load(path, allow_pickle=False)
    except Exception as e:  # a bad zip, a pickled array, a truncated file: the engine's, not ours
        raise CaptureError(f"{path}: unreadable capture ({type(e).__name__}: {e})") from None
    try:
        with z:
            arrays = {k: z[k] for k in z.files}
    except Exception as e:  # a bad zip, a pickled array, a truncated file: the engine's, not ours
        raise CaptureError(f"{path}: unreadable capture ({type(e).__name__}: {e})") from None
    return validate(arrays, path, max_frames)


def wait_for(capture_dir: Path, tag: str, wait_s: float) -> Path | None:
    """The capture file of a tag once it exists (engines write it before they answer, but a
    server's stages may finish a moment apart), or None after wait_s."""
    path = Path(capture_dir) / f"{tag}.npz"
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
    return path


def encode(arrays: dict) -> bytes:
    """An npz of these arrays with the schema version: codes as int64, audio as float32."""
    out = {k: np.asarray(v) for k, v in arrays.items()}
    for name in ("codes", "ref_codes", "talker_ref_codes", "input_ref_codes"):
        if name in out:
            out[name] = out[name].astype(np.int64).reshape(-1, CODEBOOKS)
    if "wav" in out:
        out["wav"] = out["wav"].astype(np.float32).reshape(-1)
    for name in ("sample_rate", "lead_samples"):
        if name in out:
            out[name] = np.int64(out[name])
    for name in ("talker_prompt", "talker_tokens"):
        if name in out:
            out[name] = out[name].astype(np.int64).reshape(-1)
    if "talker_topk_ids" in out:
        out["talker_topk_ids"] = out["talker_topk_ids"].astype(np.int64)
    if "talker_topk_logprobs" in out:
        out["talker_topk_logprobs"] = out["talker_topk_logprobs"].astype(np.float32)
    for name in (*INPUT_IDS, "input_non_streaming"):
        if name in out:
            out[name] = out[name].astype(np.int64).reshape(-1 if name != "input_non_streaming" else ())
    if "input_speaker_embedding" in out:
        out["input_speaker_embedding"] = out["input_speaker_embedding"].astype(np.float32).reshape(-1)
    if "input_speaker_dtype" in out:
        out["input_speaker_dtype"] = np.array(str(out["input_speaker_dtype"]))
    if "input_prompt_embeds" in out:  # (rows, hidden): its shape is the reader's to check
        out["input_prompt_embeds"] = out["input_prompt_embeds"].astype(np.float32)
    if "input_prompt_dtype" in out:
        out["input_prompt_dtype"] = np.array(str(out["input_prompt_dtype"]))
    if PROMPT_LABELS in out:
        out[PROMPT_LABELS] = out[PROMPT_LABELS].astype(np.int64).reshape(-1)
    if PROMPT_CACHED in out:
        out[PROMPT_CACHED] = np.int64(out[PROMPT_CACHED])
    out["schema_version"] = np.int64(SCHEMA_VERSION)
    buf = io.BytesIO()
    np.savez(buf, **out)
    return buf.getvalue()


def write(path: Path, arrays: dict, durable: bool = True) -> Path:
    """Write a capture file atomically (a temporary file renamed over it: a reader never sees half
    of one), readable by the tester whatever the writer's umask. `durable=False` skips the fsync:
    for files rewritten within one request, where a power cut loses the run anyway."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode(arrays))
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path

