"""Run by the vLLM-Omni environment's interpreter (tests/test_vllm_omni_prompt_inputs.py): vLLM-Omni
0.30's real `Qwen3TTSPromptEmbedsBuilder` on a tiny checkpoint's config and tokenizer, with seeded
embedding tables in the talker's bf16, building prompts for every task and layout, wrapped by
difftest's prompt-input observer (runners/vllm_omni/difftest_capture/.../prompt_inputs.py).

    .venv-vllm-omni/bin/python tests/vllm_omni_prompt_inputs_check.py TINY_DIR [CASES.json]   -> one JSON line

Per case: whether the wrapped build returned the same tensors as the unwrapped one, and the
observed input_* arrays next to what they must be (the tokenizer on the chat templates, the ids
from the config, the embedding as given, cast to bf16). One case plants a defect in the builder's
config (English's language id moved) to show the capture reports what was used, not what should
have been.

Under `rows`, the talker's assembled prompt as the capture files it (`input_prompt_embeds`,
hooks.PromptRows) from the talker's real `preprocess`, called as model runner v1 calls it (keyword
arguments, `request_id`, the request's buffer merged by v1's own `_update_intermediate_buffer`),
wrapped as a server wraps it (hooks.install): per case in one step, next to the rows `preprocess`
returned and the unwrapped builder's prompt; a prefill over three steps with two positions reserved
past the prompt (the pad rows); a reservation shorter than the prompt; a step that skips positions;
a prefix-cache start; a recompute of the whole prompt after it was filed (a resume after
preemption: not filed again). And the two planted entries (cases/planted/speaker-row-moved,
instruct-after-header: their patches applied to a copy of the release's builder module): every
input_* array as the release's, the rows that differ. With CASES.json (`{name: {"path", "task_type", "info"}}`, tests/test_vllm_omni_prompt_inputs.py)
it also builds those requests' prompts and reports what they were made of under `cross`, to be
compared with what qwen-tts's prompt code made of the same requests. Nothing here needs a server.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

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
    out["rows"] = rows(tiny, cases)
    if len(sys.argv) > 2:
        out["cross"] = cross(json.loads(Path(sys.argv[2]).read_text()))
    print(json.dumps(out))
    return 0


# --------------------------------------------------------------------------------------------
# the assembled prompt, as the talker's preprocess hands it to the forward (model runner v1)
# --------------------------------------------------------------------------------------------

def talker(path: Path, build=None):
    """A Qwen3-TTS talker with vLLM-Omni's own `preprocess` and just the state it reads: the prompt
    builder (`builder`, or the one given), the pad embedding, the embedding dtype; model runner v1."""
    from vllm_omni.model_executor.models.qwen3_tts import qwen3_tts_talker as tt

    cls = tt.Qwen3TTSTalkerForConditionalGeneration
    cfg = Qwen3TTSConfig.from_pretrained(str(path))
    m = cls.__new__(cls)
    torch.nn.Module.__init__(m)
    m.config, m.talker_config = cfg, cfg.talker_config
    m._prompt_builder = build or builder(path, cfg)
    m._tts_pad_embed = m._prompt_builder._tts_pad_embed_buffer.reshape(1, -1)  # the builder's, as the talker shares it
    m._embedding_dtype = torch.bfloat16
    m._use_v2_model_runner = False
    return m


def prefill(model, rid: str, info: dict, plan, length: int):
    """The request's prefill steps as model runner v1 runs them: `plan` is [(positions computed
    before, positions scheduled)]; `info` is the request's buffer (v1 keeps it from step to step,
    and across a preemption), updated in place by v1's own `_update_intermediate_buffer`. Returns
    the rows each step handed over."""
    from vllm_omni.worker.gpu_model_runner import OmniGPUModelRunner

    runner = SimpleNamespace(requests={rid: SimpleNamespace()}, model=model, model_intermediate_buffer={rid: info})
    runner._store_value = lambda *a: OmniGPUModelRunner._store_value(runner, *a)
    got = []
    for computed, n in plan:
        req = runner.model_intermediate_buffer[rid]
        req.update({"request_id": rid, "_omni_prompt_len": length, "_omni_num_computed_tokens": computed,
                    "_omni_is_prefill": computed < length})
        with torch.inference_mode():
            ids_out, embeds, update = model.preprocess(input_ids=torch.zeros(n, dtype=torch.long), input_embeds=None,
                                                       **req)
        OmniGPUModelRunner._update_intermediate_buffer(runner, rid, update)
        got.append(embeds.clone())
    return got


def filed_rows(cap, rid: str) -> dict:
    f = cap.store.take_talker([rid])
    if f is None:
        return {"filed": False}
    out = {"filed": True, "keys": sorted(f)}
    for k in ("input_prompt_dtype", "input_prompt_missing"):
        if k in f:
            out[k] = str(f[k])
    if "input_prompt_cached" in f:
        out["input_prompt_cached"] = int(f["input_prompt_cached"])
    if "input_prompt_embeds" in f:
        out["embeds"] = f["input_prompt_embeds"]
        out["embeds_dtype"] = str(f["input_prompt_embeds"].dtype)
    out["inputs"] = {k: f[k] for k in f if k.startswith("input_") and not k.startswith("input_prompt")}
    return out


def planted_module(entry: str, work: Path):
    """The release's builder module with cases/planted/<entry>/plant.patch applied, imported apart."""
    import importlib.util
    import subprocess

    rel = "vllm_omni/model_executor/models/qwen3_tts/prompt_embeds_builder.py"
    root = work / entry
    (root / rel).parent.mkdir(parents=True)
    (root / rel).write_bytes(Path(peb.__file__).read_bytes())
    r = subprocess.run(["git", "apply", "-p1", str(REPO / "cases" / "planted" / entry / "plant.patch")], cwd=root,
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": str(work)})
    assert r.returncode == 0, r.stderr
    spec = importlib.util.spec_from_file_location(f"planted_{entry.replace('-', '_')}", root / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows(tiny: Path, cases: dict) -> dict:
    import tempfile

    from runners.vllm_omni.difftest_capture.difftest_capture import hooks

    work = Path(tempfile.mkdtemp(prefix="prompt-rows-"))
    cap = hooks.install(work / "capture")  # as a server installs it: preprocess and the builder wrapped
    unwrapped = getattr(peb.Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds, "__wrapped__")
    out = {"cases": {}}

    def built(m, task, info):
        with torch.inference_mode():
            return unwrapped(m._prompt_builder, task_type=task, info_dict=copy.deepcopy(info))[0]

    def compare(m, task, info, handed, f, length):
        want = built(m, task, info)
        n = int(want.shape[0])
        handed = torch.cat(handed).float().numpy()
        e = f.get("embeds")
        return {"rows_built": n, "length": length, "dtype": f.get("input_prompt_dtype"),
                "cached": f.get("input_prompt_cached"), "missing": f.get("input_prompt_missing"),
                "embeds_dtype": f.get("embeds_dtype"), "shape": None if e is None else list(e.shape),
                "equal_handed": e is not None and e.shape == handed.shape and bool(np.array_equal(e, handed)),
                "equal_built": e is not None and bool(np.array_equal(e[:min(n, length)],
                                                                     want.float().numpy()[:min(n, length)])),
                "pad_rows": e is not None and bool(np.array_equal(
                    e[n:], m._tts_pad_embed.float().numpy().repeat(max(0, length - n), 0))),
                "inputs_filed": sorted(f.get("inputs", {}))}

    # every task and layout in one step, the prompt reserved exactly
    cases = {name: (path, task, {**info, "task_type": [task]}, b) for name, (path, task, info, b) in cases.items()}
    for name, (path, task, info, _) in cases.items():
        m = talker(path)
        n = int(built(m, task, info).shape[0])
        rid = f"v1-{name}"
        handed = prefill(m, rid, copy.deepcopy(info), [(0, n)], n)
        out["cases"][name] = compare(m, task, info, handed, filed_rows(cap, rid), n)

    path, task, info, _ = cases["icl_streaming"]
    m = talker(path)
    n = int(built(m, task, info).shape[0])
    # three steps, two positions reserved past the prompt: the pad rows preprocess appends are the talker's too
    handed = prefill(m, "v1-chunked", copy.deepcopy(info), [(0, 5), (5, 9), (14, n + 2 - 14)], n + 2)
    out["chunked"] = compare(m, task, info, handed, filed_rows(cap, "v1-chunked"), n + 2)
    # the prompt recomputed from position 0 after it was filed (a resume after preemption): v1 keeps the
    # request's buffer and builds nothing; v2 drops it on preemption and builds again. Neither is filed again.
    buf = copy.deepcopy(info)
    handed = prefill(m, "v1-resume", buf, [(0, n)], n)
    first = filed_rows(cap, "v1-resume")
    replay = prefill(m, "v1-resume", buf, [(0, n)], n)  # v1: the kept buffer
    kept = filed_rows(cap, "v1-resume")
    prefill(talker(path), "v1-resume", copy.deepcopy(info), [(0, n)], n)  # a fresh buffer: built again
    rebuilt = cap.store.take_talker(["v1-resume"])
    out["resume"] = {"first": compare(m, task, info, handed, first, n), "kept_filed": kept["filed"],
                     "rebuilt_keys": sorted(rebuilt) if rebuilt is not None else None,
                     # what v1's replay of the prompt hands the forward (not asserted: the release's, reported)
                     "replay_is_pad": bool(torch.equal(replay[0].float(), m._tts_pad_embed.float().expand(n, -1)))}
    # a reservation 3 positions shorter than the prompt: the talker gets (and the capture keeps) the reserved ones
    handed = prefill(m, "v1-cut", copy.deepcopy(info), [(0, n - 3)], n - 3)
    out["cut"] = compare(m, task, info, handed, filed_rows(cap, "v1-cut"), n - 3)
    # a step that skips positions 5-7: not the talker's prompt, said so
    prefill(m, "v1-gap", copy.deepcopy(info), [(0, 5), (8, n - 8)], n)
    out["gap"] = {k: v for k, v in filed_rows(cap, "v1-gap").items() if k not in ("embeds", "inputs")}
    # a prefix-cache hit on the first 8 positions: those rows from the prompt the first step built
    handed = prefill(m, "v1-cached", copy.deepcopy(info), [(8, n - 8)], n)
    out["cached"] = compare(m, task, info, [built(m, task, info)[:8].to(torch.bfloat16), *handed],
                            filed_rows(cap, "v1-cached"), n)

    # the planted entries: the same requests through the release's builder and each planted one
    out["planted"] = {}
    for entry, case in (("speaker-row-moved", "custom_voice"), ("instruct-after-header", "voice_design"),
                        ("instruct-after-header", "custom_voice_streaming_instruct"),
                        ("speaker-row-moved", "custom_voice_streaming_instruct")):
        mod = planted_module(entry, work / "planted" / case)
        prompt_inputs.observe_builder(mod.Qwen3TTSPromptEmbedsBuilder, mod)
        path, task, info, _ = cases[case]
        release, planted = talker(path), talker(path)
        b = planted._prompt_builder
        planted._prompt_builder = mod.Qwen3TTSPromptEmbedsBuilder(
            config=b._config, talker_config=b._talker_config, model_path=str(path), text_embedding=b._text_embedding,
            text_projection=b._text_projection, codec_embed=b._codec_embed,
            residual_code_embeddings=b._residual_code_embeddings, speaker_encoder=None,
            tts_pad_embed=b._tts_pad_embed_buffer, encode_ref_audio_batch=None)
        n = int(built(release, task, info).shape[0])
        got = {}
        for side, m in (("release", release), ("planted", planted)):
            prefill(m, f"{entry}-{case}-{side}", copy.deepcopy(info), [(0, n)], n)
            got[side] = filed_rows(cap, f"{entry}-{case}-{side}")
        a, p = got["release"], got["planted"]
        same_inputs = sorted(a["inputs"]) == sorted(p["inputs"]) and all(
            np.array_equal(a["inputs"][k], p["inputs"][k]) for k in a["inputs"])
        differ = np.flatnonzero((a["embeds"] != p["embeds"]).any(axis=1)).tolist() \
            if a["embeds"].shape == p["embeds"].shape else None
        out["planted"][f"{entry}/{case}"] = {"same_inputs": same_inputs, "rows": n, "differ": differ,
                                             "instruct_ids": len(a["inputs"]["input_instruct_ids"]),
                                             "prefill": len(a["inputs"]["input_codec_prefill"])}
    return out


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
