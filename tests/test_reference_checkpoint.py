"""The tiny checkpoint builder: determinism, manifest, geometry both engines load."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from reference_support import REPO, Stopwatch, build_checkpoints, reference_python, tiny  # noqa: F401

TYPES = ("base", "custom_voice", "voice_design")


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    # Two fresh builder processes at once: seed 0 again, and seed 1.
    py = str(reference_python())
    cmds = {seed: [py, "-m", "runners.reference.tiny_checkpoint", str(tmp_path / f"s{seed}"), "--type", "base",
                   "--seed", str(seed)] for seed in (0, 1)}
    procs = {s: subprocess.Popen(c, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for s, c in cmds.items()}
    for s, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]

    reference = _files(tiny / "base")
    again = _files(tmp_path / "s0")
    assert set(again) == set(reference)
    assert "model.safetensors" in again and "speech_tokenizer/model.safetensors" in again
    for name in reference:
        assert again[name] == reference[name], f"{name} differs between two seed-0 builds"

    other = _files(tmp_path / "s1")
    assert other["model.safetensors"] != reference["model.safetensors"]
    assert other["speech_tokenizer/model.safetensors"] != reference["speech_tokenizer/model.safetensors"]
    # Only the weights (and the manifest recording them) depend on the seed.
    for name in reference:
        if not name.endswith(("model.safetensors", "difftest-checkpoint.json")):
            assert other[name] == reference[name], name
    assert json.loads(other["difftest-checkpoint.json"])["seed"] == 1


def test_manifest_records_every_file(tiny):
    for mtype in TYPES:
        folder = tiny / mtype
        manifest = json.loads((folder / "difftest-checkpoint.json").read_text())
        assert manifest["type"] == mtype and manifest["seed"] == 0 and manifest["builder_version"] == 1
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and p.name != "difftest-checkpoint.json"}
        assert set(manifest["files"]) == on_disk
        for rel, digest in manifest["files"].items():
            assert hashlib.sha256((folder / rel).read_bytes()).hexdigest() == digest, rel
        assert manifest["built_with"]["qwen-tts"] == "0.1.1"


def test_geometry_is_the_shared_one(tiny):
    for mtype in TYPES:
        cfg = json.loads((tiny / mtype / "config.json").read_text())
        talker = cfg["talker_config"]
        assert cfg["tts_model_type"] == mtype and cfg["model_type"] == "qwen3_tts"
        assert talker["hidden_size"] == 32 and talker["head_dim"] == 32 and talker["vocab_size"] == 3072
        assert talker["rope_scaling"]["mrope_section"] == [4, 6, 6]
        assert sum(talker["rope_scaling"]["mrope_section"]) == talker["head_dim"] // 2
        assert talker["code_predictor_config"]["hidden_size"] == 16
        assert cfg["speaker_encoder_config"]["enc_dim"] == talker["hidden_size"]
        # Compact, hand-written: no empty model_type that the speaker-encoder config cannot take.
        assert "model_type" not in cfg["speaker_encoder_config"]
        gen = json.loads((tiny / mtype / "generation_config.json").read_text())
        assert gen == {"do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
                       "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
                       "subtalker_top_k": 50, "max_new_tokens": 8192}
        vocab = json.loads((tiny / mtype / "vocab.json").read_text())
        assert "assistant" in vocab  # one token: qwen-tts slices the prompt by position
    speakers = json.loads((tiny / "custom_voice" / "config.json").read_text())["talker_config"]["spk_id"]
    assert speakers == {"alice": 3000, "bob": 3001}


def test_existing_build_is_kept_and_a_different_one_refused(tiny):
    before = {p: p.stat().st_mtime_ns for p in tiny.rglob("*") if p.is_file()}
    # The builder as `python -m runners.reference.tiny_checkpoint` runs it, then which heavy modules it imported.
    code = ("import sys; from runners.reference.tiny_checkpoint import main; rc = main(sys.argv[1:]); "
            "print(sorted(m for m in ('qwen_tts', 'torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    with Stopwatch() as sw:
        r = subprocess.run([str(reference_python()), "-c", code, str(tiny)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "[]"  # no qwen_tts, torch or transformers import: a hash check only
    assert {p: p.stat().st_mtime_ns for p in tiny.rglob("*") if p.is_file()} == before  # no rebuild
    print(f"kept build checked in {sw.seconds:.2f} s")

    r = build_checkpoints(tiny / "base", "--type", "base", "--seed", "7")
    assert r.returncode == 2
    assert "seed 7" in r.stderr and "--force" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in tiny.rglob("*") if p.is_file()} == before


def test_two_builders_of_the_same_folder_take_turns(tiny, tmp_path):
    """Two runs starting on an empty store build the same checkpoint at once: both succeed, the
    second finds the first's build (the one that lost the race used to die with a traceback)."""
    py = str(reference_python())
    cmd = [py, "-m", "runners.reference.tiny_checkpoint", str(tmp_path / "same"), "--type", "base"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert _files(tmp_path / "same") == _files(tiny / "base")
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no half build left behind


def test_the_default_build_listens_it_scales_the_request_inputs_and_nothing_else(tiny, tmp_path):
    """The default build (--listen 3) against plain random weights (--listen 0): text embeddings,
    the language and speaker rows, the x-vector projection and both heads scaled by 3, everything
    else equal, and the manifests say which is which (the plain one carries no such key, so its
    hash is what the builder gave before listening became the default)."""
    r = build_checkpoints(tmp_path / "plain", "--type", "base", "--listen", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    code = f"""
import json, torch
from safetensors.torch import load_file
a = load_file({str(tmp_path / 'plain' / 'model.safetensors')!r}); b = load_file({str(tiny / 'base' / 'model.safetensors')!r})
scaled = sorted(k for k in a if not torch.equal(a[k], b[k]))
emb = 'talker.model.codec_embedding.weight'
rows = [i for i in range(a[emb].shape[0]) if not torch.equal(a[emb][i], b[emb][i])]
ok = all(torch.allclose(b[k], 3 * a[k]) for k in scaled if k != emb) and torch.allclose(b[emb][rows], 3 * a[emb][rows])
print(json.dumps({{"scaled": scaled, "rows": rows, "ok": bool(ok)}}))
"""
    p = subprocess.run([str(reference_python()), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["ok"]
    assert got["rows"] == [2050, 2053, 2054, 2055, 2058, 2061, 2064, 2069, 2070, 2071, 3000, 3001]
    assert "talker.model.text_embedding.weight" in got["scaled"] and "talker.codec_head.weight" in got["scaled"]
    assert "speaker_encoder.fc.weight" in got["scaled"]
    assert all(k.startswith(("talker.model.text_embedding", "talker.model.codec_embedding", "talker.codec_head",
                             "talker.code_predictor.lm_head", "speaker_encoder.fc")) for k in got["scaled"])
    assert json.loads((tiny / "base" / "difftest-checkpoint.json").read_text())["listen"] == 3.0
    assert "listen" not in json.loads((tmp_path / "plain" / "difftest-checkpoint.json").read_text())


def test_a_store_gets_the_set_from_the_cache_byte_for_byte_and_a_damaged_entry_is_built_again(tiny, tmp_path,
                                                                                              monkeypatch):
    """tiny_checkpoints: the first store builds the set into difftest's cache, the next ones copy it
    (the builder then checks each copy against its manifest); the copies are the builder's own bytes."""
    from difftest.cache import Cache
    from difftest.engines import reference

    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    py = reference_python()
    first = reference.tiny_checkpoints(tmp_path / "store1", py)
    [entry] = Cache().entries("tiny-checkpoint")
    created = json.loads(entry.path.with_name(entry.path.name + ".entry.json").read_text())["created"]
    second = reference.tiny_checkpoints(tmp_path / "store2", py)
    assert [p.replace("store1", "store2") for p in first] == second
    for t, folder in zip(TYPES, second):
        assert _files(tiny / t) == _files(Path(folder)), t  # what a build in place writes
    # the second store was a copy: the entry was not built again
    [again] = Cache().entries("tiny-checkpoint")
    assert json.loads(again.path.with_name(again.path.name + ".entry.json").read_text())["created"] == created

    weights = entry.path / "base" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"damaged!")
    third = reference.tiny_checkpoints(tmp_path / "store3", py)
    assert _files(Path(third[0])) == _files(tiny / "base")  # rebuilt, not copied damaged

    # the key is what the build comes from: the seed, and the builder's source
    key = reference.tiny_cache_key(py)
    assert reference.tiny_cache_key(py, seed=1) != key
    fake = tmp_path / "repo"
    for name in reference._BUILDER_SOURCES:
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_bytes((REPO / name).read_bytes())
    monkeypatch.setattr(reference, "REPO", fake)
    assert reference.tiny_cache_key(py) == key
    for name in ("runners/reference/tiny_checkpoint.py", "difftest/family.py"):  # the builder, the codec's numbers
        (fake / name).write_text((fake / name).read_text() + "\n# changed\n")
        assert reference.tiny_cache_key(py) != key
        key = reference.tiny_cache_key(py)


HAZARD_CHECK = """
import json, sys
from safetensors.torch import load_file
plain, hazard = (load_file(p + "/model.safetensors") for p in sys.argv[1:3])
changed = sorted(k for k in plain if not (plain[k].shape == hazard[k].shape and (plain[k] == hazard[k]).all()))
carriers = {}
for k in ("talker.text_projection.linear_fc2.bias", "talker.code_predictor.small_to_mtp_projection.bias"):
    shift = (hazard[k] - plain[k]).abs()
    carriers[k] = {"channels": int((shift > 0).sum()), "median_bias": float(plain[k].abs().median()),
                   "shift": float(shift.max())}
print(json.dumps({"changed": changed, "carriers": carriers}))
"""


def test_the_hazard_build_plants_massive_channels_and_changes_nothing_else(tiny, tmp_path):
    """--hazard (issue 58): a few channels of the talker's and the code predictor's input carry a
    constant ~1000x the median, their hidden-state norms rescaled to match; every other weight, the
    codec and the tokenizer are the plain build's, and the manifest says what was planted."""
    py = str(reference_python())
    r = subprocess.run([py, "-m", "runners.reference.tiny_checkpoint", str(tmp_path / "hz"), "--type", "base",
                        "--hazard"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    plain, hazard = _files(tiny / "base"), _files(tmp_path / "hz")
    manifest = json.loads(hazard["difftest-checkpoint.json"])
    assert manifest["hazard"] == {"ratio": 1000.0, "talker_channels": 2, "code_predictor_channels": 1}
    assert "hazard" not in json.loads(plain["difftest-checkpoint.json"])  # the plain build's bytes are as before
    assert {n for n in plain if plain[n] != hazard[n]} == {"model.safetensors", "difftest-checkpoint.json"}
    out = subprocess.run([py, "-c", HAZARD_CHECK, str(tiny / "base"), str(tmp_path / "hz")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert all(k.endswith(("layernorm.weight", "model.norm.weight")) or k in got["carriers"] for k in got["changed"])
    assert not any("q_norm" in k or "k_norm" in k for k in got["changed"])  # per-head norms are not the hidden's
    talker, predictor = got["carriers"].values()
    assert talker["channels"] == 2 and predictor["channels"] == 1
    for c in (talker, predictor):  # the median of the input rows, not of the bias: large against either
        assert c["shift"] > 100 * c["median_bias"]
