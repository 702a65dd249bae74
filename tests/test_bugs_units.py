"""The bug corpus's entries and mutant environments, without serving anything: the loader names
what is wrong with an entry, and a mutant is the release with exactly its patch, the release untouched."""

import difflib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from vllm_omni_support import omni_python

from difftest.bugs.corpus import load_corpus
from difftest.bugs.judge import judge
from difftest.bugs.mutant import RECORD, mutant_env, release_site
from difftest.bugs.run import exit_code
from difftest.errors import BadInput

TALKER = "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py"
LINE = '            mm.setdefault("codes", {})["ref"] = ref_code_list\n'


def make_entry(root: Path, site: Path | None = None, **over) -> Path:
    """A corpus with one entry (the seed's revert, written here against the release's own file)."""
    folder = root / "ref-leak-4373"
    folder.mkdir(parents=True)
    sha = hashlib.sha256((site / TALKER).read_bytes()).hexdigest() if site else "0" * 64
    source = (site / TALKER).read_text().splitlines(keepends=True) if site else [LINE]
    reverted = [ln.replace("= ref_code_list", "= [[r for r in ref_code_list if r.numel() > 0][-1]]")
                if ln == LINE else ln for ln in source]
    patch = difflib.unified_diff(source, reverted, f"a/{TALKER}", f"b/{TALKER}")
    (folder / "revert.patch").write_text("".join(patch))
    entry = {"id": "ref-leak-4373", "title": "the seed", "upstream": {"issue": 4370, "pr": 4373},
             "release": "0.30.0", "patch": "revert.patch", "source_sha256": {TALKER: sha}, "cpu": True,
             "run": {"candidate": "vllm-omni", "suite": "voice-clone-concurrency", "concurrency": 4},
             "expect": {"verdict": "contamination", "stage": "handoff", "donor": True}}
    for key, value in over.items():
        if value is None:
            entry.pop(key)
        else:
            entry[key] = value
    (folder / "bug.yaml").write_text(yaml.safe_dump(entry))
    return root


def test_an_entry_loads_with_its_suite_and_upstream(tmp_path):
    (e,) = load_corpus(make_entry(tmp_path))
    assert (e.id, e.candidate, e.concurrency, e.suite.name) == ("ref-leak-4373", "vllm-omni", 4,
                                                              "voice-clone-concurrency.yaml")
    assert e.upstream_label == "issue #4370 / pr #4373" and e.patch.name == "revert.patch"


@pytest.mark.parametrize("over, words", [
    ({"run": None}, "field 'run' missing"),
    ({"run": {"candidate": "sglang", "suite": "smoke", "concurrency": 4}}, "run.candidate 'sglang'"),
    ({"run": {"candidate": "vllm-omni", "suite": "nope", "concurrency": 4}}, "run.suite 'nope': no suite"),
    ({"run": {"candidate": "vllm-omni", "suite": "smoke", "concurrency": 4, "config": {"max_modl_len": 1}}},
     "run.config key 'max_modl_len' is no vLLM-Omni setting"),
    ({"expect": {"verdict": "contamination", "stage": "everywhere"}}, "expect.stage 'everywhere'"),
    ({"patch": "gone.patch"}, "patch 'gone.patch' not found"),
    ({"cpu": False}, "cpu is false: say why in cpu_why"),
    ({"id": "other"}, "must equal its folder's name"),
    ({"run": {"candidate": "vllm-omni", "suite": "smoke", "concurrency": True}}, "'concurrency' is bool"),
])
def test_a_broken_entry_is_named(tmp_path, over, words):
    root = make_entry(tmp_path, **over)
    with pytest.raises(BadInput, match=words) as e:
        load_corpus(root)
    assert "ref-leak-4373" in str(e.value)


def test_an_unknown_id_is_named(tmp_path):
    with pytest.raises(BadInput, match=r"no bug gremlin-1 in .* \(known: ref-leak-4373\)"):
        load_corpus(make_entry(tmp_path), only=["gremlin-1"])


def test_the_mutant_is_the_release_with_exactly_its_patch(tmp_path, monkeypatch):
    # The cache inside a git work tree, as difftest's default .cache/difftest in a checkout is: there
    # `git apply` once skipped every path silently, and the "mutant" was the release itself.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    base = omni_python()
    site, version = release_site(base)
    assert version == "0.30.0"
    before = hashlib.sha256((site / TALKER).read_bytes()).hexdigest()
    (e,) = load_corpus(make_entry(tmp_path / "corpus", site))
    with mutant_env(e, base, tmp_path / "build.log") as python:
        where = subprocess.run([str(python), "-c", "import vllm_omni, importlib.metadata as m; "
                                "print('@', vllm_omni.__file__, m.version('vllm-omni'))"],
                               capture_output=True, text=True, check=True).stdout.split("@")[-1].split()
        env = python.parent.parent
        mutated = (Path(where[0]).parent / TALKER.split("/", 1)[1]).read_text()
        record = json.loads((env / RECORD).read_text())
        # bytecode: an unpatched module's is the release's own file (linked); the patched one's is
        # new and matches its new source, so no process of the mutant compiles vllm_omni again
        own_site = Path(record["site"])
        pyc = lambda root, rel: importlib.util.cache_from_source(str(root / rel))  # noqa: E731
        assert os.path.samefile(pyc(own_site, "vllm_omni/version.py"), pyc(site, "vllm_omni/version.py"))
        patched = Path(pyc(own_site, TALKER))
        assert not os.path.samefile(patched, pyc(site, TALKER))
        header = patched.read_bytes()[8:16]  # mtime and size of the source it was compiled from
        src = (own_site / TALKER).stat()
        assert header == int(src.st_mtime).to_bytes(4, "little") + (src.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    assert Path(where[0]).is_relative_to(env) and where[1] == "0.30.0"  # its own package, the release's metadata
    assert "[[r for r in ref_code_list if r.numel() > 0][-1]]" in mutated and LINE not in mutated
    assert hashlib.sha256((site / TALKER).read_bytes()).hexdigest() == before  # the release untouched
    assert record["bug"] == "ref-leak-4373" and record["release"] == "0.30.0"
    with mutant_env(e, base, tmp_path / "build.log") as again:  # reused, not rebuilt
        assert again == python
    assert (tmp_path / "build.log").read_text().count("-m venv") == 1


def test_a_patch_for_other_sources_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    (e,) = load_corpus(make_entry(tmp_path / "corpus"))  # sha256 of nothing the release ships
    with pytest.raises(BadInput, match=f"the release's {TALKER} does not match the source the patch was written"):
        with mutant_env(e, omni_python(), tmp_path / "build.log"):
            pass


def test_a_patch_that_does_not_apply_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    site, _ = release_site(omni_python())
    root = make_entry(tmp_path / "corpus", site)
    patch = root / "ref-leak-4373" / "revert.patch"
    patch.write_text(patch.read_text().replace("= ref_code_list", "= ref_codes_list", 1))
    (e,) = load_corpus(root)
    with pytest.raises(BadInput, match="ref-leak-4373: revert.patch does not apply to vLLM-Omni 0.30.0"):
        with mutant_env(e, omni_python(), tmp_path / "build.log"):
            pass
    assert not list((tmp_path / "cache" / "bug-mutant").glob("*.entry.json"))  # nothing half-built kept


def test_a_patch_that_applies_but_does_not_compile_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE", str(tmp_path / "cache"))
    site, _ = release_site(omni_python())
    root = make_entry(tmp_path / "corpus", site)
    patch = root / "ref-leak-4373" / "revert.patch"
    text = patch.read_text()
    assert "[-1]]" in text
    patch.write_text(text.replace("[-1]]", "[-1]]]", 1))  # an unmatched bracket in the added line
    (e,) = load_corpus(root)
    with pytest.raises(BadInput, match="ref-leak-4373: revert.patch applies but the patched source does not compile"):
        with mutant_env(e, omni_python(), tmp_path / "build.log"):
            pass


def test_caught_needs_the_verdict_the_stage_and_the_donor(tmp_path):
    (e,) = load_corpus(make_entry(tmp_path))
    seg = {"id": "vcc-02", "verdict": "contamination", "stage": "handoff", "donor": "vcc-04", "summary": "s",
           "first_divergent_chunk": 0}
    assert judge(e, {"verdict": "fail", "segments": [seg]})["caught"]
    assert not judge(e, {"verdict": "fail", "segments": [{**seg, "donor": None}]})["caught"]
    assert not judge(e, {"verdict": "fail", "segments": [{**seg, "stage": "vocoder"}]})["caught"]
    assert not judge(e, {"verdict": "pass", "segments": [seg]})["caught"]
    # the release's own finding on the same segment is not the bug's; on another segment it is
    release = {"verdict": "fail", "segments": [seg]}
    assert not judge(e, {"verdict": "fail", "segments": [seg]}, release)["caught"]
    other = {**seg, "id": "vcc-03"}
    got = judge(e, {"verdict": "fail", "segments": [seg, other]}, release)
    assert got["caught"] and got["segment"] == "vcc-03"
    # a finding under a more serious one, the release's own on that segment, still catches
    top = {"id": "vcc-02", "verdict": "handoff_defect", "stage": "handoff", "donor": None, "summary": "zero frame",
           "first_divergent_chunk": 0}
    under = judge(e, {"verdict": "fail", "segments": [{**top, "also": [{**seg, "first_divergent_chunk": 1}]}]},
                  {"verdict": "fail", "segments": [top]})
    assert under["caught"] and under["where"] == "chunk 1, handoff, donor vcc-04"
    assert under["summary"] == "s (under handoff_defect: zero frame)"
    assert not judge(e, {"verdict": "fail", "segments": [{**top, "also": [seg]}]},
                     {"verdict": "fail", "segments": [{**top, "also": [seg]}]})["caught"]  # the release has it too
    assert exit_code([{"status": "caught"}, {"status": "known miss"}, {"status": "not on CPU"}]) == 0
    assert exit_code([{"status": "caught"}, {"status": "missed"}, {"status": "error", "exit_code": 3}]) == 1
    assert exit_code([{"status": "error", "exit_code": 3}, {"status": "error", "exit_code": 2}]) == 2
    shutil.rmtree(tmp_path)


def test_a_numerics_entry_is_judged_on_the_run_against_the_releases_own(tmp_path):
    """`numerics_regression` is no segment's verdict: the mutant's run is held against the release's
    run of the same suite (difftest/verdicts/numerics.py), as the gate holds a release against the last."""
    (e,) = load_corpus(make_entry(tmp_path, expect={"verdict": "numerics_regression", "stage": "talker",
                                                    "site": "code_predictor"}))

    def rep(off: int) -> dict:  # 4 segments, `off` of 600 code-predictor tokens off qwen-tts's top-1 in each
        return {"verdict": "pass", "segments": [], "measured_null": {
            "segments": {f"s{i}": {"talker": [1, None, 40], "code_predictor": [off, None, 600]} for i in range(4)}}}

    got = judge(e, rep(40), rep(20))
    assert got["caught"] and got["where"] == "talker (code_predictor)" and got["got"] == ["numerics_regression@talker (code_predictor)"]
    assert "160/2400" in got["summary"] and got["numerics"]["effect"] == 2.0
    missed = judge(e, rep(21), rep(20))
    assert not missed["caught"] and missed["numerics"]["verdict"] == "pass"
    alone = judge(e, rep(40), None)  # no release run of the same cell to hold it against: not judged, not caught
    assert not alone["caught"] and "release's own run" in alone["summary"]


@pytest.mark.parametrize("corpus", ["cases/bugs", "cases/planted"])
def test_every_shipped_entry_loads_and_its_patch_applies_to_the_release(corpus):
    """The shipped corpora, as `difftest bugs` would build them: each entry loads, names the
    release's own sources, and its patch applies there (checked, nothing written)."""
    from difftest.bugs.mutant import _apply, check_source

    root = Path(__file__).resolve().parents[1] / corpus
    entries = load_corpus(root)
    assert entries, f"{corpus} holds no entry"
    site, version = release_site(omni_python())
    for e in entries:
        if e.patch is None:
            assert e.release_carries_bug, e.id
            continue
        check_source(e, site, version)
        _apply(e.patch, site, e, check=True)
    if corpus == "cases/planted":
        assert all(not e.upstream for e in entries)  # planted by difftest: none is an upstream bug
        assert {e.id: (e.expect["verdict"], e.expect["stage"]) for e in entries} == {
            "cp-activations-fp8": ("numerics_regression", "talker"),
            "language-german-as-english": ("talker_defect", "talker_input"),
            "speaker-scaled-0.9": ("talker_defect", "talker_input"),
            "speaker-row-moved": ("talker_defect", "talker_input"),
            "instruct-after-header": ("talker_defect", "talker_input")}
