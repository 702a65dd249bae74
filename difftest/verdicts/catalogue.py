"""The verdicts, in one table (issue 59, item 1): for each, how serious it is, whether the default
policy fails on it, whether a run with it is clean, its colour on the dashboard and what it means in
one line. The ranking classify picks the top finding by, report.json's verdict list and counts, the
policy's known verdicts and defects, the dashboard's legends and tables all read it; the README's
table and default_policy.yaml's fail_on are tested against it (tests/test_verdict_catalogue.py).

Rows are in report.json's order (its `counts` list them so); `rank` is the seriousness, 0 the most
serious. A new verdict is a row here and the check that gives it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Verdict:
    name: str
    rank: int | None  # seriousness among a segment's findings, 0 first; None: a run-level finding only
    fails: bool  # the default policy fails a run on it
    clean: bool  # nothing diverged beyond what the numerics allow
    colour: str  # the dashboard's
    meaning: str  # one line: the README's table
    reported_as: str | None = None  # a finding's kind that the report names otherwise


TABLE = (
    Verdict("identical", 13, False, True, "#2e7d32", "same codes, bit-identical audio"),
    Verdict("numeric_drift", 12, False, True, "#7cb342",
            "same codes, audio within tolerance (16-bit quantisation, float noise)"),
    Verdict("code_divergence", 10, False, False, "#f9a825",
            "codes differ from qwen-tts's, but teacher-forced under qwen-tts they are plausible (bf16 numerics), "
            "or @N parts from @1 on a near-tie"),
    Verdict("audio_divergence", 11, False, False, "#ffb300", "no codes captured; audio differs beyond tolerance"),
    Verdict("length_mismatch", 9, True, False, "#ef6c00", "same codes as far as both go, one side longer"),
    Verdict("concurrency_defect", 7, True, False, "#d84315", "candidate@N differs from candidate@1"),
    Verdict("history_defect", 8, True, False, "#e65100",
            "the same segment served again at 1, after the others, differs from its first serving"),
    Verdict("vocoder_defect", 6, True, False, "#ad1457",
            "audio is not what the reference vocoder makes of the candidate's own codes"),
    Verdict("talker_defect", 3, True, False, "#6a1b9a",
            "the talker's codes are not what qwen-tts's talker decodes for the request (teacher forcing: tokens far "
            "down its ranking, outside its sampling support), or it was prompted with another prompt (reserved "
            "positions padded or cut); at any concurrency"),
    Verdict("handoff_defect", 2, True, False, "#b71c1c",
            "the vocoder got another reference prefix or other frames than the talker had (dropped, mis-trimmed, "
            "lost)"),
    Verdict("contamination", 1, True, False, "#c62828",
            "decoded with another request's reference, or with its own cut to another request's length: `donor` "
            "names it (`donor_kind` `codes` or `length`)"),
    Verdict("error", 0, True, False, "#37474f",
            "no usable result (engine error, dead runner, NaN audio, missing segment)"),
    Verdict("reference_encoder_defect", 4, True, False, "#880e4f",
            "the talker's reference codes are not what qwen-tts's encoder makes of the voice (another frame count, "
            "or under half the entries agree with its float32 and with its bf16 encoding)"),
    Verdict("sampling_defect", None, True, False, "#4a148c",
            "run-level (report.json `sampling`): the candidate's sampled tokens are not drawn as qwen-tts draws them"),
    # the vocoder's audio longer or shorter on the same codes: ranked with the vocoder's findings, reported
    # as length_mismatch
    Verdict("vocoder_length", 5, True, False, "#ef6c00", "", reported_as="length_mismatch"),
)
BY_NAME = {v.name: v for v in TABLE}

VERDICTS = tuple(v.name for v in TABLE if v.reported_as is None)  # what report.json may say
RANK = tuple(v.name for v in sorted((v for v in TABLE if v.rank is not None), key=lambda v: v.rank))  # a finding's kinds
SEGMENT_VERDICTS = tuple(v for v in VERDICTS if BY_NAME[v].rank is not None)
FAILS = tuple(v for v in VERDICTS if BY_NAME[v].fails)  # the default policy's fail_on
CLEAN = tuple(v for v in VERDICTS if BY_NAME[v].clean)
COLOURS = {v: BY_NAME[v].colour for v in VERDICTS}


def reported(kind: str) -> str:
    """The verdict a finding of this kind is reported as."""
    return BY_NAME[kind].reported_as or kind


def readme_table() -> str:
    """The README's table of segment verdicts, as the catalogue says."""
    rows = [f"| `{v}` | {BY_NAME[v].meaning} | {'yes' if BY_NAME[v].fails else 'no'} |" for v in SEGMENT_VERDICTS]
    return "\n".join(["| verdict | meaning | fails by default |", "|---|---|---|", *rows])
