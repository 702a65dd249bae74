"""qwen-tts's assembled talker prompt as the reference runner records it (issue 57, item 5), on the real
tiny checkpoints: for every task and layout (Base in-context and x-vector clones, CustomVoice with and
without an instruction, VoiceDesign; streaming and non-streaming) each row's label is right, checked by
rebuilding the row from its label and the request's recorded ingredients with the model's own
embeddings; no row is "unknown"; a batch's prompts are its requests' own, bit for bit (what makes the
CPU engine's float32 prompt exact at N); and qwen-tts in bf16 lies inside the policy's allowance."""

from __future__ import annotations

import json
import subprocess

from reference_support import REPO, reference_python, tiny  # noqa: F401

from difftest.verdicts.policy import load_policy

SCRIPT = r'''
import json, sys
from pathlib import Path
import numpy as np
import torch
from runners.reference.checkpoint import open_checkpoints
from runners.reference.engine import QwenTTSEngine, Utterance
from difftest.engines.capture import PROMPT_ROWS

tiny, voices = Path(sys.argv[1]), Path(sys.argv[2])
ck = open_checkpoints([str(tiny / t) for t in ("base", "custom_voice", "voice_design")])
DEC = {"do_sample": False, "subtalker_dosample": False, "repetition_penalty": 1.0, "max_new_tokens": 2, "seed": 0}
alba = (voices / "alba.wav", (voices / "alba.txt").read_text().strip())
bruno = (voices / "bruno.wav", (voices / "bruno.txt").read_text().strip())


def cases(ns):
    d = {**DEC, "non_streaming_mode": ns}
    return {
        "icl": Utterance("Good morning, how are you today?", "English", "voice_clone", d, *alba),
        "icl-long-text": Utterance("A much longer text than the reference, " * 3, "English", "voice_clone", d,
                                   voices / "bruno.wav", "Hi."),
        "xvector": Utterance("The weather is lovely.", "German", "voice_clone", d, *bruno, xvector_only=True),
        "custom": Utterance("Hello there, friend.", "English", "custom_voice", d, speaker="alice"),
        "custom-instruct": Utterance("Hello there.", "Auto", "custom_voice", d, speaker="bob",
                                     instructions="Speak cheerfully."),
        "design": Utterance("A designed voice speaks.", "English", "voice_design", d, instructions="A calm voice."),
    }


def check_rows(model, inp):
    """Rebuild each row from its label and the recorded ingredients; the labels that do not fit."""
    cfg, talker = model.config, model.talker
    tc = cfg.talker_config

    def txt(ids):
        return talker.text_projection(talker.get_text_embeddings()(torch.tensor([ids])))[0]

    def codec(ids):
        return talker.get_input_embeddings()(torch.tensor([ids]))[0]

    def frame(codes):
        return (codec([int(codes[0])])[0] + sum(talker.code_predictor.get_input_embeddings()[i - 1](
            torch.tensor([int(codes[i])]))[0] for i in range(1, 16)))

    with torch.no_grad():
        bos, eos, pad = txt([cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id])
        c_pad, c_bos = codec([tc.codec_pad_id, tc.codec_bos_id])
        ids, instr = inp["input_text_ids"].tolist(), inp["input_instruct_ids"].tolist()
        text, ref_text = ids[3:-5], inp["input_ref_text_ids"].tolist()[3:-2]
        spk = (codec(inp["input_speaker_id"].tolist())[0] if len(inp["input_speaker_id"])
               else torch.from_numpy(inp["input_speaker_embedding"]) if len(inp["input_speaker_embedding"]) else None)
        n = {"instruction": 0, "role": 0, "codec prefill": 0, "reference text": 0, "text": 0, "reference codes": 0}
        labels = [PROMPT_ROWS[i] for i in inp["input_prompt_rows"]]
        wrong = []
        for r, (label, got) in enumerate(zip(labels, inp["input_prompt_embeds"])):
            parts = label.split(" + ")
            if label in ("instruction", "role", "codec prefill", "speaker", "codec pad"):
                want = {"instruction": lambda: txt([instr[n["instruction"]]])[0],
                        "role": lambda: txt([ids[n["role"]]])[0],
                        "codec prefill": lambda: codec([int(inp["input_codec_prefill"][n["codec prefill"]])])[0] + pad,
                        "speaker": lambda: spk + pad,
                        "codec pad": lambda: c_pad + bos}[label]()
                n[label] = n.get(label, 0) + 1
            else:
                text_part = next((p for p in parts if p in ("reference text", "text", "text eos")), None)
                codec_part = next((p for p in parts if p in ("codec bos", "reference codes")), None)
                if text_part == "reference text":
                    t = txt([ref_text[n["reference text"]]])[0]; n["reference text"] += 1
                elif text_part == "text":
                    t = txt([text[n["text"]]])[0]; n["text"] += 1
                else:
                    t = eos if text_part == "text eos" else pad
                if codec_part == "reference codes":
                    c = frame(inp["input_ref_codes"][n["reference codes"]]); n["reference codes"] += 1
                else:
                    c = c_bos if codec_part == "codec bos" else c_pad
                want = t + c
            want = want.float().numpy()
            if not np.allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(want).max()))):
                wrong.append([r, label, float(np.abs(got - want).max())])
    # every ingredient used up where the layout holds it whole
    used = {"instruction": len(instr), "role": 3, "codec prefill": len(inp["input_codec_prefill"])}
    wrong += [[-1, k, n[k]] for k, v in used.items() if n[k] != v]
    return labels, wrong


out = {}
f32 = QwenTTSEngine(ck, dtype="float32", threads=1)
b16 = QwenTTSEngine(ck, dtype="bfloat16", threads=1)
for ns in (False, True):
    for name, u in cases(ns).items():
        inp = f32.synthesize(u).inputs
        labels, wrong = check_rows(f32.model(u.task).model, inp)
        other = b16.synthesize(u).inputs
        e, e32 = other["input_prompt_embeds"], inp["input_prompt_embeds"]
        codes_same = np.array_equal(other["input_ref_codes"], inp["input_ref_codes"])
        keep = [i for i, l in enumerate(labels) if codes_same or "reference codes" not in l]
        rel = (np.abs(e[keep] - e32[keep]).max(1) / np.abs(e32[keep]).max(1)).max() if e.shape == e32.shape else None
        out[f"{name}-{'ns' if ns else 'st'}"] = {
            "labels": labels, "wrong": wrong, "rows": len(e32), "dtype": str(inp["input_prompt_dtype"]),
            "bf16_dtype": str(other["input_prompt_dtype"]), "bf16_rows": len(e),
            "bf16_rel": None if rel is None else float(rel), "row_labels": len(inp["input_prompt_rows"])}
# a batch: each request's rows as alone, bit for bit
us = [cases(False)["icl"], cases(False)["icl-long-text"]]
batch = f32.synthesize_batch(us, codes_only=True)
out["batch_equal"] = [bool(np.array_equal(b.inputs["input_prompt_embeds"],
                                          f32.synthesize(u).inputs["input_prompt_embeds"])) for b, u in zip(batch, us)]
print("RESULT " + json.dumps(out))
'''


def runs(labels: list[str]) -> list[tuple[str, int]]:
    out: list[list] = []
    for x in labels:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return [(x, n) for x, n in out]


def test_each_row_of_qwen_tts_prompt_is_labelled_with_what_it_holds(tiny, tmp_path):  # noqa: F811
    p = subprocess.run([str(reference_python()), "-c", SCRIPT, str(tiny), str(REPO / "cases" / "voices")], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert got.pop("batch_equal") == [True, True]
    assert len(got) == 12
    for case, r in got.items():
        assert r["wrong"] == [] and "unknown" not in r["labels"] and r["row_labels"] == r["rows"], (case, r)
        assert r["dtype"] == "float32" and r["bf16_dtype"] == "bfloat16" and r["bf16_rows"] == r["rows"], (case, r)
        # qwen-tts's own bf16 prompt: inside the allowance the verdict gives a bf16 candidate
        assert 0 < r["bf16_rel"] < load_policy().prompt_bf16_max_rel, (case, r["bf16_rel"])
    head = [("role", 3), ("codec prefill", 4)]
    tail = {  # what follows the codec pad row, per layout (the text lengths are the tiny tokenizer's)
        "icl-st": lambda rs: rs[0][0] == "reference text + codec bos" and {x for x, _ in rs[1:]} <= {
            "reference text + reference codes", "text + reference codes", "text eos + reference codes",
            "reference codes"},
        "icl-ns": lambda rs: [x for x, _ in rs] == ["reference text", "text", "text eos", "codec bos",
                                                      "reference codes"],
        "st": lambda rs: rs == [("text + codec bos", 1)],
        "ns": lambda rs: [x for x, _ in rs] == ["text", "text eos", "codec bos"] and rs[1][1] == rs[2][1] == 1,
    }
    for case, r in got.items():
        rs = runs(r["labels"])
        kind, layout = case.rsplit("-", 1)
        instr = kind in ("custom-instruct", "design")
        assert (rs[0][0] == "instruction") == instr, (case, rs)
        rs = rs[1:] if instr else rs
        prefill = 3 if kind == "custom-instruct" else 4  # Auto: no language id
        assert rs[:2] == [("role", 3), ("codec prefill", prefill)] or rs[:2] == head, (case, rs)
        speaker = kind != "design"  # a custom voice's speaker, a clone's x-vector; a designed voice has none
        assert (rs[2] == ("speaker", 1)) == speaker, (case, rs)
        assert rs[2 + speaker] == ("codec pad", 1), (case, rs)
        rest = rs[3 + speaker:]
        key = f"icl-{layout}" if kind.startswith("icl") else layout
        assert tail[key](rest), (case, rest)
    # a text longer than the reference's codes, streaming: the text runs on past the codes (the rest trails)
    assert runs(got["icl-long-text-st"]["labels"])[-1][0] == "text + reference codes"
