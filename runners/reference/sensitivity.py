"""How much each input a request carries moves the talker: the sensitivity table of a checkpoint.

    .venv-reference/bin/python -m runners.reference.sensitivity CHECKPOINT_DIR [--frames 24] [--json]

Teacher forcing sees a wrong input only as far as the talker's codes depend on it. For each input
(the text, its last word, the language, the speaker embedding, the in-context reference codes, the
instructions) one request is decoded greedily with that input changed, and its codes are set
against the unchanged request's: the share of frames whose 16 codes moved, and teacher-forced
under the unchanged request, the share of frames still qwen-tts's top-1 (codebook 0) and the worst
gap to the top-1 in nats. An input whose change leaves the codes where they were is one no
comparison can hold the candidate to on this checkpoint. CHECKPOINT_DIR is a tiny checkpoint set
(base, custom_voice, voice_design), as runners.reference.tiny_checkpoint builds it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from runners.reference.checkpoint import open_checkpoints
from runners.reference.engine import QwenTTSEngine, Utterance

REPO = Path(__file__).resolve().parents[2]
VOICES = REPO / "cases" / "voices"
TEXT = "Good morning, how are you today? The weather is lovely."
OTHER_TEXT = "A completely different sentence about the mountains."


def _voice(name: str) -> tuple[Path, str]:
    return VOICES / f"{name}.wav", (VOICES / f"{name}.txt").read_text().strip()


def cases(frames: int) -> list[tuple[str, Utterance, object]]:
    """(input, request, change): `change` maps the request (and the engine, for prompt-level changes) to
    the changed request or to a prompt hook."""
    decode = {"do_sample": False, "subtalker_dosample": False, "repetition_penalty": 1.0, "max_new_tokens": frames + 1,
              "seed": 0}
    wav, transcript = _voice("alba")
    other_wav, other_transcript = _voice("bruno")
    icl = Utterance(TEXT, "English", "voice_clone", decode, voice_wav=wav, transcript=transcript)
    custom = Utterance(TEXT, "English", "custom_voice", decode, speaker="alice", instructions="Speak happily.")
    design = Utterance(TEXT, "English", "voice_design", decode, instructions="A calm, low voice.")
    return [
        ("text", icl, lambda u: replace(u, text=OTHER_TEXT)),
        ("last word", icl, lambda u: replace(u, text=u.text.rsplit(" ", 1)[0])),
        ("language", icl, lambda u: replace(u, language="German")),
        ("speaker embedding", icl, ("spk", other_wav, other_transcript)),
        ("reference codes", icl, ("ref", other_wav, other_transcript)),
        ("speaker (custom voice)", custom, lambda u: replace(u, speaker="bob")),
        ("instructions (custom voice)", custom, lambda u: replace(u, instructions="Speak very sadly and slowly.")),
        ("instructions (voice design)", design, lambda u: replace(u, instructions="A bright, fast, high voice.")),
    ]


def _with_prompt_part(engine: QwenTTSEngine, u: Utterance, part: str, other_wav: Path, other_transcript: str):
    """The request decoded with one part of its voice-clone prompt taken from another voice."""
    from runners.reference.engine import GENERATE_KWARGS

    tts = engine.model(u.task)
    mine = engine._voice_prompt(tts, u)[0]
    theirs = tts.create_voice_clone_prompt(ref_audio=str(other_wav), ref_text=other_transcript)[0]
    if part == "spk":
        item = replace(mine, ref_spk_embedding=theirs.ref_spk_embedding)
    else:  # the other voice's reference codes (and its transcript, which belongs to them)
        item = replace(mine, ref_code=theirs.ref_code, ref_text=theirs.ref_text)
    capture = engine._models[u.task][1]
    capture.codes = None
    engine._import().manual_seed(0)
    tts.generate_voice_clone(text=u.text, language=u.language, voice_clone_prompt=[item],
                             **{k: u.decode[k] for k in GENERATE_KWARGS if k in u.decode})
    return capture.codes[0].numpy()


def measure(checkpoint_dir: Path, frames: int) -> list[dict]:
    cps = open_checkpoints([str(checkpoint_dir / t) for t in ("base", "custom_voice", "voice_design")])
    engine = QwenTTSEngine(cps)
    rows = []
    for name, u, change in cases(frames):
        base = engine.synthesize(u).codes
        if callable(change):
            moved = engine.synthesize(change(u)).codes
        else:
            moved = _with_prompt_part(engine, u, *change)
        n = min(len(base), len(moved))
        sc = engine.score(u, moved, None, ended_by_eos=False)
        gap = np.maximum(sc.arrays["top1_logprob"] - sc.arrays["logprob"], 0)
        rows.append({"input": name, "task": u.task, "frames": n,
                     "frames_moved": round(float((base[:n] != moved[:n]).any(axis=1).mean()), 3),
                     "forced_top1_share": round(float((sc.arrays["rank"][:, 0] == 0).mean()), 3),
                     "forced_worst_gap": round(float(gap.max()), 3),
                     "forced_worst_rank": int(sc.arrays["rank"].max())})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runners.reference.sensitivity", description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint_dir", type=Path)
    ap.add_argument("--frames", type=int, default=72, help="frames per request: enough for the whole text to reach the talker")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    args = ap.parse_args(argv)
    rows = measure(args.checkpoint_dir, args.frames)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| input changed | task | frames moved | forced top-1 share (cb0) | worst gap (nats) | worst rank |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['input']} | {r['task']} | {r['frames_moved']:.0%} | {r['forced_top1_share']:.0%} | "
              f"{r['forced_worst_gap']} | {r['forced_worst_rank']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
