"""The talker's input against qwen-tts's, field by field (capture schema v3, issue #29).

What a prompt is made of (text ids, instruction ids, an in-context clone's reference text ids, the
codec prefill with its language id, a custom voice's speaker id, a clone's speaker embedding, the
layout) is a deterministic function of the request, so it is compared exactly, on any model and at
any sensitivity, and a defect is placed where it enters: stage `talker_input`, naming the field and
its first differing position. The codes only show such a defect as far as the model listens to it
(on the seeded checkpoint the language moves the forced log-probabilities little).

The speaker embedding is compared exactly where both sides computed it in the same dtype on the
same device kind (the encoder's numerics are then the same: the CPU test engine's float32 against
the float32 reference gives the same bits). A bf16 candidate's (vLLM-Omni's encoder runs in bf16)
is compared with qwen-tts's own x-vector from a bf16 copy of its encoder (the reference's
`speaker_embedding_bf16`, its twin in the candidate's numerics), allowed as far from it as bf16
moves qwen-tts's own on this voice (max |twin - float32|, measured per voice in the same reference
run): two bf16 implementations of one encoder part by rounding flips (vLLM-Omni 0.30.0 against the
twin on smoke: 0 and 0.0625, a 1-2 ulp flip in 4 of 32 values of one voice, whose allowance is
0.102), a scaled or another voice's x-vector by far more. Without the twin it is not judged, and
the segment's notes say so.

A field that is wrong and equal to another request's of the run is that request's: `contamination`
with the donor, `donor_kind` naming the field. Only fields that identify a request by themselves
(text, reference text and codes, speaker embedding) name donors from anywhere in the run; a low-entropy field
(the language's prefill, a speaker id, the layout) names one only when it is right at concurrency 1
and equals a co-batched request's at N (otherwise two requests of one language would look alike).

Where both sides also recorded the assembled prompt (the rows the talker received), it is compared
row by row as well (difftest/verdicts/talker_prompt.py): an ingredient put in the wrong place, a row
dropped, added or altered after the builder. A field that differs stays the finding (it is the more
specific); the prompt's difference is then a note.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..engines.captured import SPEAKER_BF16, captured
from ..results import Result
from .check import Check
from .encoder import encoder_disagrees
from .evidence import Evidence, Finding, reference_name, same, talker_stage
from .policy import Policy
from .talker_prompt import prompt_findings

NAMES = {"input_text_ids": "text ids", "input_instruct_ids": "instruction ids",
         "input_ref_text_ids": "reference text ids", "input_ref_codes": "reference codes",
         "input_codec_prefill": "codec prefill (language)",
         "input_speaker_id": "speaker id", "input_speaker_embedding": "speaker embedding",
         "input_non_streaming": "non-streaming layout"}
DONOR_KIND = {"input_text_ids": "text", "input_instruct_ids": "instruction", "input_ref_text_ids": "reference text",
              "input_ref_codes": "prompt codes", "input_codec_prefill": "language", "input_speaker_id": "speaker id",
              "input_speaker_embedding": "speaker embedding", "input_non_streaming": "layout"}
IDENTIFYING = ("input_text_ids", "input_ref_text_ids", "input_ref_codes", "input_speaker_embedding")


def inputs_of(r: Result | None) -> dict | None:
    """A result's talker input (a capture's, or the reference's), None where it was not recorded."""
    return captured(r).inputs


@dataclass
class Mismatch:
    field: str
    at: int  # first differing position (the shorter length where one is a prefix of the other)
    mine: str
    theirs: str

    @property
    def name(self) -> str:
        return NAMES[self.field]


def _dtype(inputs: dict) -> str:
    return str(inputs["input_speaker_dtype"].reshape(-1)[0]) if inputs["input_speaker_dtype"].size else ""


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _first_diff(a: np.ndarray, b: np.ndarray) -> int:
    a, b = a.reshape(-1), b.reshape(-1)
    n = min(len(a), len(b))
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if len(d) else n


def _show(a: np.ndarray, at: int) -> str:
    if a.ndim == 2:  # codes: (frames, 16), `at` a frame
        return f"{len(a)} frames" + (f", frame {at} = {a[at, :4].tolist()}..." if at < len(a) else "")
    a = a.reshape(-1)
    if a.dtype.kind == "f":
        return f"{len(a)} values, norm {float(np.linalg.norm(a)):.4g}" + (f", [{at}] = {a[at]:.4g}" if at < len(a) else "")
    part = a[max(0, at - 2):at + 3]
    return f"{len(a)} ids, [{max(0, at - 2)}:{at + 3}] = {part.tolist()}" if len(a) > 5 else str(a.tolist())


def bf16_allowance(mine: dict, theirs: dict) -> float | None:
    """How far a bf16 x-vector may be from qwen-tts's bf16 twin: as far as bf16 moves qwen-tts's
    own (max |twin - float32|) on this voice; None where there is no twin to judge by."""
    twin, f32 = theirs.get(SPEAKER_BF16), theirs["input_speaker_embedding"]
    if _dtype(mine) != "bfloat16" or _dtype(theirs) == "bfloat16" or twin is None or twin.shape != f32.shape:
        return None
    return float(np.abs(twin - f32).max()) if twin.size else 0.0


def _matches(field: str, mine: dict, theirs: dict) -> bool:
    """Whether `mine`'s field is `theirs` (qwen-tts's), as the field is judged."""
    a = mine[field]
    if field == "input_speaker_embedding" and a.size:
        allowed = bf16_allowance(mine, theirs)
        if allowed is not None:
            twin = theirs[SPEAKER_BF16]
            return a.shape == twin.shape and float(np.abs(a - twin).max()) <= allowed
    return _equal(a, theirs[field])


def compare(mine: dict, theirs: dict) -> tuple[list[Mismatch], list[str]]:
    """Fields of `mine` (a candidate's) that differ from `theirs` (qwen-tts's), and notes on the
    fields that could not be judged. The bf16 allowance is measured on the reference's device: a
    candidate placed on another device kind (`--candidate-device`) is judged by it as well, with
    other kernels than it was measured on (docs/verdicts.md, the speaker embedding row)."""
    out, notes = [], []
    for field in NAMES:
        a, b = mine[field], theirs[field]
        if field == "input_speaker_embedding" and a.size and b.size:
            da, db = _dtype(mine), _dtype(theirs)
            if da != db and bf16_allowance(mine, theirs) is not None:
                if not _matches(field, mine, theirs):
                    at = int(np.argmax(np.abs(a - theirs[SPEAKER_BF16]))) if a.shape == theirs[SPEAKER_BF16].shape else 0
                    out.append(Mismatch(field, at, _show(a, at), _show(theirs[SPEAKER_BF16], at) + " (qwen-tts in bf16)"))
                continue
            if da != db:
                notes.append(f"speaker embedding not judged: the candidate's is {da or 'of unknown dtype'}, "
                             f"qwen-tts's {db}, and no tolerance "
                             f"is measured between them")
                continue
        if not _equal(a, b):
            at = _first_diff(a, b) // (a.shape[1] if a.ndim == 2 and a.shape[1] else 1)  # codes: a frame
            out.append(Mismatch(field, at, _show(a, at), _show(b, at)))
    return out, notes


def donor_of(m: Mismatch, mine: dict, others: dict[str, dict], peers: set, right_at_one: bool) -> str | None:
    """The other request whose qwen-tts input this wrong field equals, if any (see the module's
    rule on low-entropy fields)."""
    a = mine[m.field]
    if not a.size:
        return None
    pool = sorted(others) if m.field in IDENTIFYING else sorted(p for p in others if p in peers) if right_at_one else []
    for sid in pool:
        if _matches(m.field, mine, others[sid]):
            return sid
    return None


def input_findings(ev: Evidence, comps: dict, notes: list, policy: Policy) -> list[Finding]:
    """What the talker's prompt was made of against what qwen-tts made it of (verdicts/talker_input)."""
    theirs, mine = inputs_of(ev.reference), inputs_of(ev.candidate)
    if mine is None:
        notes.append("the talker's input was not captured: text, language, speaker and layout judged only "
                     "through the codes")
        return []
    if theirs is None:
        notes.append(f"no talker input from {reference_name(ev.reference)} (a reference from before it was recorded): "
                     f"not compared")
        return []
    wrong, why = compare(mine, theirs)
    notes += why
    talker = talker_stage(ev.candidate)
    encoded = talker.ref_codes if talker is not None else ev.candidate.ref_codes  # the engine's encoder's
    # The prompt's reference codes being the engine's own encoder's, whether that encoder agrees with
    # qwen-tts's (within bf16's allowance) is the encoder check's to say (reference_encoder_defect).
    wrong = [m for m in wrong if not (m.field == "input_ref_codes" and same(mine["input_ref_codes"], encoded))]
    comps["talker_input"] = {"differ": [m.field for m in wrong]}
    a, b = mine["input_speaker_embedding"], theirs["input_speaker_embedding"]
    if a.size and a.shape == b.shape:  # measured in every run: what a tolerance would rest on
        comps["talker_input"]["speaker_max_abs"] = float(np.abs(a - b).max())
    twin, allowed = theirs.get("speaker_embedding_bf16"), bf16_allowance(mine, theirs)
    if a.size and twin is not None and a.shape == twin.shape and allowed is not None:  # qwen-tts's own, in bf16
        comps["talker_input"] |= {"speaker_max_abs_bf16": float(np.abs(a - twin).max()), "speaker_allowed_bf16": allowed}
    at_one = inputs_of(ev.control)
    assembled = prompt_findings(ev, mine, theirs, comps, notes, policy, bool(wrong), at_one)
    if not wrong:
        return assembled
    wrong_at_one = {m.field for m in compare(at_one, theirs)[0]} if at_one is not None else None
    m = wrong[0]
    right_at_one = wrong_at_one is not None and m.field not in wrong_at_one
    where = " at concurrency N (right at 1)" if right_at_one else " at concurrency 1 as well" if wrong_at_one else ""
    also = f"; also: {', '.join(x.name for x in wrong[1:])}" if len(wrong) > 1 else ""
    donor = donor_of(m, mine, ev.other_inputs, set(ev.peer_ref_codes), right_at_one)
    if donor:
        return [Finding("contamination", f"the talker was prompted with {donor}'s {m.name}{where}{also}",
                         frame=0, chunk=0, stage="talker_input", donor=donor, donor_kind=DONOR_KIND[m.field])]
    theirs_ref = ev.reference.ref_codes
    if ([x.field for x in wrong] == ["input_speaker_embedding"] and len(theirs_ref)
            and encoder_disagrees(theirs_ref, encoded, policy, captured(ev.reference).ref_codes_bf16)):
        # both of the engine's encoders disagree with qwen-tts's on this voice, each beyond what the encoder
        # check allows (a bf16 encoder's codes always differ some from float32's): the audio that reached them
        return [Finding("reference_encoder_defect",
                         f"the voice's speaker embedding and its reference codes both differ from what qwen-tts's "
                         f"encoders make of it: the reference audio reached the engine changed{where}",
                         frame=0, chunk=0, stage="reference_encoder")]
    return [Finding("talker_defect", f"the talker's input differs from {reference_name(ev.reference)}'s in its {m.name}, "
                                     f"at position {m.at}: "
                     f"{m.mine} against {m.theirs}{where}{also}", frame=0, chunk=0, stage="talker_input")]


TALKER_INPUT = Check("talker_input", gives=("contamination", "reference_encoder_defect", "talker_defect"),
                     judge=lambda ev, ctx: input_findings(ev, ctx.comps, ctx.notes, ctx.policy),
                     applies=lambda ev: ev.candidate.has_codes)
