"""Run by the vLLM-Omni environment's interpreter (tests/test_vllm_omni_prompt_inputs.py): vLLM-Omni
0.30's real `Qwen3TTSPromptEmbedsBuilder` on a tiny checkpoint's config and tokenizer, with seeded
embedding tables in the talker's bf16, building prompts for every task and layout, wrapped by
difftest's prompt-input observer (runners/vllm_omni/difftest_capture/.../prompt_inputs.py).

    .venv-vllm-omni/bin/python tests/vllm_omni_prompt_inputs_check.py TINY_DIR [CASES.json]   -> one JSON line

Per case: whether the wrapped build returned the same tensors as the unwrapped one, and the
observed input_* arrays next to what they must be (the tokenizer on the chat templates, the ids
from the config, the embedding as given, cast to bf16). One case plants a defect in the builder's
config (English's language id moved) to show the capture reports what was used, not what should
have been. With CASES.json (`{name: {"path", "task_type", "info"}}`, tests/test_vllm_omni_prompt_inputs.py)
it also builds those requests' prompts and reports what they were made of under `cross`, to be
compared with what qwen-tts's prompt code made of the same requests. Nothing here needs a server.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_omni.model_executor.models.qwen3_tts import prompt_embeds_builder as peb  # noqa: E402
from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig  # noqa: E402

from runners.vllm_omni.difftest_capture.difftest_capture import prompt_inputs  # noqa: E402


def builder(path: Path, cfg=None):
    cfg = cfg or Qwen3TTSConfig.from_pretrained(str(path))
    t = cfg.talker_config
    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16
    text_emb = torch.nn.Embedding(t.text_vocab_size, t.text_hidden_size).to(dt)
    proj = torch.nn.Linear(t.text_hidden_size, t.hidden_size).to(dt)
    codec = torch.nn.Embedding(t.vocab_size, t.hidden_size).to(dt)
    residual = [torch.nn.Embedding(2048, t.hidden_size).to(dt) for _ in range(t.num_code_groups - 1)]
    for m in (text_emb, proj, codec, *residual):
        for p in m.parameters():
            p.data = torch.randn(p.shape, generator=g).to(dt)
    return peb.Qwen3TTSPromptEmbedsBuilder(
        config=cfg, talker_config=t, model_path=str(path), text_embedding=text_emb, text_projection=proj,
        codec_embed=codec, residual_code_embeddings=lambda: residual, speaker_encoder=None,
        tts_pad_embed=torch.randn(t.hidden_size, generator=g).to(dt), encode_ref_audio_batch=None)


def ids(b, text: str) -> list[int]:
    return b.get_text_tokenizer()(text, padding=False)["input_ids"]


def main() -> int:
    tiny = Path(sys.argv[1])
    base, cv, vd = (Path(tiny) / n for n in ("base", "custom_voice", "voice_design"))
    g = torch.Generator().manual_seed(1)
    spk = torch.randn(32, generator=g)
    ref_code = torch.randint(0, 2048, (7, 16), generator=g)
    cases = {
        "custom_voice": (cv, "CustomVoice", {"text": ["Hello world."], "language": ["English"], "speaker": ["bob"]}, False),
        "custom_voice_streaming_instruct": (cv, "CustomVoice", {
            "text": ["Hello world."], "language": ["German"], "speaker": ["alice"], "instruct": ["Whisper."],
            "non_streaming_mode": [False]}, False),
        "voice_design": (vd, "VoiceDesign", {"text": ["Bonjour."], "language": ["French"], "instruct": ["A calm voice."]}, False),
        "xvector_auto": (base, "Base", {"text": ["Hi there."], "language": ["Auto"],
                                        "voice_clone_prompt": [{"ref_spk_embedding": spk, "icl_mode": False}]}, False),
        "icl_streaming": (base, "Base", {"text": ["Hi there, again."], "language": ["English"], "ref_text": ["A reference."],
                                         "voice_clone_prompt": [{"ref_spk_embedding": spk, "ref_code": ref_code,
                                                                 "icl_mode": True}]}, False),
        "icl_non_streaming_batched": (base, "Base", {
            "task_type": ["Base"], "text": ["Hi there, again."], "language": ["Spanish"], "ref_text": ["A reference."],
            "non_streaming_mode": [True],
            "voice_clone_prompt": [{"ref_spk_embedding": spk, "ref_code": ref_code, "icl_mode": True}]}, True),
    }
    cls = peb.Qwen3TTSPromptEmbedsBuilder
    unwrapped = cls.build_prompt_embeds
    prompt_inputs.observe_builder(cls, peb)
    out = {}
    for planted in (False, True):
        for name, (path, task, info, batched) in cases.items():
            if planted and name != "icl_streaming":
                continue
            cfg = Qwen3TTSConfig.from_pretrained(str(path))
            english = cfg.talker_config.codec_language_id["english"]
            if planted:  # the defect: English prompts get Chinese's id
                cfg.talker_config.codec_language_id["english"] = cfg.talker_config.codec_language_id["chinese"]
            b = builder(path, cfg)
            infos = copy.deepcopy(info), copy.deepcopy(info)
            if batched:  # the batched path's precomputed text ids
                for i in infos:
                    b.preprocess_infos_batch(req_infos=[i], device=torch.device("cpu"))
            precomputed = peb.PRECOMPUTED_TEXT_IDS_KEY in infos[1] and peb.PRECOMPUTED_REF_IDS_KEY in infos[1]
            with torch.inference_mode():
                want = unwrapped(b, task_type=task, info_dict=infos[0])
                prompt_inputs.take()
                got = b.build_prompt_embeds(task_type=task, info_dict=infos[1])
            arrays = prompt_inputs.take()
            same = all((x is None and y is None) or (isinstance(x, torch.Tensor) and torch.equal(x, y)) or x == y
                       for x, y in zip(want, got))
            t = cfg.talker_config
            lang = (info["language"][0]).lower()
            lang_id = None if lang == "auto" else t.codec_language_id[lang]
            expect = {
                "input_text_ids": ids(b, peb.build_assistant_text(info["text"][0])),
                "input_instruct_ids": ids(b, peb.build_instruct_text(info["instruct"][0])) if "instruct" in info else [],
                "input_codec_prefill": ([t.codec_nothink_id, t.codec_think_bos_id, t.codec_think_eos_id] if lang_id is None
                                        else [t.codec_think_id, t.codec_think_bos_id, lang_id, t.codec_think_eos_id]),
                "input_speaker_id": [t.spk_id[info["speaker"][0]]] if task == "CustomVoice" else [],
                "input_ref_text_ids": ids(b, peb.build_ref_text(info["ref_text"][0])) if "ref_text" in info else [],
                "input_ref_codes": ref_code.tolist() if "ref_text" in info else [],
                "input_speaker_embedding": spk.to(torch.bfloat16).float().tolist() if task == "Base" else [],
                "input_speaker_dtype": "bfloat16" if task == "Base" else "",
                "input_non_streaming": int(info.get("non_streaming_mode", [task != "Base"])[0]),
            }
            observed = arrays if not isinstance(arrays, dict) else {k: v.tolist() for k, v in arrays.items()}
            out[name + ("_planted" if planted else "")] = {
                "same_output": bool(same), "precomputed": precomputed, "observed": observed, "expect": expect, "english_id": english}
    if len(sys.argv) > 2:
        out["cross"] = cross(json.loads(Path(sys.argv[2]).read_text()))
    print(json.dumps(out))
    return 0


def cross(cases: dict) -> dict:
    """Each request's prompt inputs as the (wrapped) builder observed them."""
    out = {}
    for name, c in cases.items():
        b = builder(Path(c["path"]))
        with torch.inference_mode():
            b.build_prompt_embeds(task_type=c["task_type"], info_dict=copy.deepcopy(c["info"]))
        arrays = prompt_inputs.take()
        out[name] = {k: v.tolist() for k, v in arrays.items()} if isinstance(arrays, dict) else str(arrays)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
