"""A finding's bundle: what a maintainer files upstream, runnable without difftest.

    bundle/
      repro.py        stdlib only (difftest/repro/standalone.py): sends the minimal requests, exits 1/0
      bundle.json     the requests, their arrival, the expected audio, the tolerance
      suite.yaml      the minimal case as a difftest suite (`difftest run`, `difftest bisect --suite`)
      voices/         the reference voices the requests send
      expected/       per request: the audio it must give (32-bit float, from frame 0)
      ISSUE.md        title, environment, symptom, diagnosis, donor, minimal requests, command
      specdiff.png    the target's spectrogram against the expected one, and the difference
      deploy-overlay.yaml  vLLM-Omni's deploy configuration as difftest served it (a vLLM-Omni candidate)

Everything is read from the final probe's run folder (its report.json and result files).
"""

from __future__ import annotations

import html
import json
import re
import shutil
from pathlib import Path

from ..engines.apis import API_OF_PATH, SpeechApi, api_for
from ..errors import DifftestError
from ..family import SAMPLES_PER_FRAME
from ..results import atomic_write, read_result
from ..suites import wavio
from ..suites.suite import load_suite
from .probe import Finding, write_suite
from .shrink import Case

STANDALONE = Path(__file__).with_name("standalone.py")


class NoBundle(DifftestError):
    """This try's run lacks audio a bundle needs (a request that failed); another try may have it."""


def _audio(path: str, run_dir: Path):
    p = Path(path)
    return read_result(p if p.is_absolute() else run_dir / p)


AGAINST = {"own_c1": "the candidate's own audio at concurrency 1",
           "qwen_tts": "the reference's audio ({}, float32)",
           "clean": "the clean control's audio (the same engine and numerics without the defect)"}


def write_bundle(folder: Path, origin, finding: Finding, case: Case, probe_dir: Path, policy, meta: dict,
                 clean_dir: Path | None = None) -> dict:
    """Write the bundle for the minimal case whose probe ran in `probe_dir`; returns bundle.json.
    `clean_dir`: the same case's probe on the clean control, whose audio is then the expected."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    suite_path = write_suite(origin.suite, case, folder, f"repro-{finding.segment}", copy_voices=True)
    suite = load_suite(suite_path)
    report = json.loads((probe_dir / "run" / "report.json").read_text())
    segs = {s["id"]: s for s in report["segments"]}
    against = ("own_c1" if case.concurrency > 1 and finding.needs_concurrency else
               "clean" if clean_dir is not None else "qwen_tts")
    clean = ({s["id"]: s for s in json.loads((clean_dir / "run" / "report.json").read_text())["segments"]}
             if against == "clean" else {})
    requests = []
    (folder / "expected").mkdir()
    for seg in suite.segments:
        arts = dict(segs[seg.id].get("artifacts") or {})
        if against == "clean":
            arts["clean"] = ((clean.get(seg.id) or {}).get("artifacts") or {}).get("candidate")
        need = ("candidate", {"own_c1": "control", "qwen_tts": "reference", "clean": "clean"}[against])
        if not all(arts.get(k) for k in need):
            raise NoBundle(f"{probe_dir}: {seg.id} has no {' or '.join(k for k in need if not arts.get(k))} audio "
                           f"({segs[seg.id]['verdict']}: {segs[seg.id].get('summary', '')[:120]})")
        cand = _audio(arts["candidate"], probe_dir / "run")
        want = _audio(arts[need[1]], (clean_dir if need[1] == "clean" else probe_dir) / "run")
        exp = f"expected/{seg.id}.wav"
        wavio.write(folder / exp, want.grid_wav, want.sample_rate, "float")  # exact: no second quantisation
        api = api_for(seg)
        body = api.repro_body(seg)
        item = {"id": seg.id, "expected": exp, "lead_samples": cand.lead_samples, "path": api.path,
                "answer": api.answer}
        if "ref_audio" in body:
            body.pop("ref_audio")
            item["ref_audio_file"] = str(seg.voice.wav.relative_to(folder))
        item["body"] = body
        requests.append(item)
    title = issue_title(finding, case, meta)
    bundle = {"format": "difftest.repro-bundle/1", "title": title, "target": finding.segment,
              "donor": finding.donor, "concurrency": case.concurrency,
              "pattern": "barrier" if case.pattern == "batch" else case.pattern,
              "against": against, "against_label": AGAINST[against].format(suite.family.reference_name),
              "samples_per_frame": SAMPLES_PER_FRAME, "chunks": dict(origin.suite.chunks),
              "tolerance": {"close_max_abs": policy.close_max_abs, "close_snr_db": policy.close_snr_db},
              "requests": requests}
    atomic_write(folder / "bundle.json", (json.dumps(bundle, indent=1, ensure_ascii=False) + "\n").encode())
    overlay = (report.get("candidate") or {}).get("deploy_overlay")
    if overlay and Path(overlay).is_file():
        shutil.copyfile(overlay, folder / "deploy-overlay.yaml")
    shutil.copyfile(STANDALONE, folder / "repro.py")
    (folder / "repro.py").chmod(0o755)
    picture = _picture(folder, shown_by(report, finding), probe_dir / "run", against,
                       clean.get(finding.segment), clean_dir)
    atomic_write(folder / "ISSUE.md", issue_text(origin, finding, case, report, bundle, meta, picture).encode())
    return bundle


def shown_by(report: dict, finding: Finding) -> dict:
    """The report's segment that shows the finding: the target's, or the donor's where the leak ran
    the other way in this try."""
    segs = {s["id"]: s for s in report["segments"]}
    seg = segs[finding.segment]
    if finding.donor and not finding.matches(seg) and finding.matches_swapped(segs.get(finding.donor)):
        return segs[finding.donor]
    return seg


def _picture(folder: Path, seg: dict, run_dir: Path, against: str, clean_seg: dict | None = None,
             clean_dir: Path | None = None) -> bool:
    from ..records.segment_media import spectrogram_difference

    arts = seg.get("artifacts") or {}
    if against == "clean":
        want = _audio(clean_seg["artifacts"]["candidate"], clean_dir / "run")
    else:
        want = _audio(arts["control" if against == "own_c1" else "reference"], run_dir)
    got = _audio(arts["candidate"], run_dir)
    view = {**seg, "first_divergent_frame": (seg.get("comparisons", {}).get("codes") or {}).get("first_divergent_frame")}
    return spectrogram_difference(want.grid_wav, got.grid_wav, got.sample_rate, folder / "specdiff.png", view)


def issue_title(finding: Finding, case: Case, meta: dict) -> str:
    kind = {"codes": "reference codes", "generated": "generated codes", "length": "reference length"}.get(
        finding.donor_kind or "codes", (finding.donor_kind or "input").replace("_", " "))
    what = {"contamination": f"one request's {kind} reach another request",
            "concurrency_defect": "audio changes with concurrency",
            "talker_defect": "the talker is conditioned on another input than the request's",
            "handoff_defect": "the talker-to-vocoder hand-off loses or alters frames",
            "length_mismatch": "the audio's length differs from the reference's",
            "vocoder_defect": "the vocoder decodes the same codes differently"}.get(finding.verdict, finding.verdict)
    cond = f"at concurrency {case.concurrency}" if case.concurrency > 1 else "at concurrency 1"
    engine = meta.get("engine_label") or "the candidate"
    return f"{engine}: {what} ({finding.stage or 'stage unknown'}, {cond}, {len(case.segments)} request(s))"


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")
_PUNCT = re.compile(r"([\\`*_\[\]|!#~$@])")  # what Markdown (GitHub's) would read as markup inside a line
_LINE_START = re.compile(r"^(\s*\d*)([-+=.)])")  # a list item, a numbered one, a heading underline


def md(value, code: bool = False) -> str:
    """Every user- or server-controlled string ISSUE.md shows (ids, texts, voice files, summaries, the
    candidate's versions, notes) goes through here: one line (line breaks become spaces, other control and
    direction characters are shown as \\xNN / \\uNNNN), shown as its own characters and nothing else, in
    prose and in table cells alike: no HTML, link, emphasis, heading or cell border. `code`: inline code
    (a fence longer than any backtick run inside) where that holds it as it is; escaped text (`<>&` as
    entities, Markdown's punctuation backslash-escaped) otherwise, so no raw markup is left for any renderer."""
    s = _CONTROL.sub(lambda m: ascii(m[0])[1:-1], " ".join(str(value).splitlines()).replace("\t", " "))
    if code and s.strip() and not set(s) & set("<>&|"):
        fence = "`" * (max(map(len, re.findall("`+", s)), default=0) + 1)
        pad = " " if "`" in (s[0], s[-1]) or s[0] == s[-1] == " " else ""
        return f"{fence}{pad}{s}{pad}{fence}"
    s = _PUNCT.sub(r"\\\1", html.escape(s, quote=False))
    return _LINE_START.sub(r"\1\\\2", s)


def _diagnosis(seg: dict) -> list[str]:
    lines = [f"- verdict {md(seg['verdict'], True)} at stage {md(seg.get('stage') or '-', True)}, first divergent "
             f"chunk {md(seg.get('first_divergent_chunk'))}: {md(seg.get('summary'))}"]
    codes = (seg.get("comparisons") or {}).get("codes") or {}
    if codes.get("frames"):
        if not codes.get("frames_differing"):
            lines.append(f"- the generated codes equal the reference's ({md(codes['frames'][0])} frames): the talker is right, "
                         f"the fault lies after it")
        else:
            lines.append(f"- codes: {md(codes['frames_differing'])} of {md(codes['frames'][0])} frames differ from "
                         f"the reference's, the first at frame {md(codes.get('first_divergent_frame'))}")
        if codes.get("ref_codes_equal") is False:
            lines.append(f"- the reference codes the vocoder got agree with the reference's encoding of the request's own "
                         f"voice in {codes.get('ref_codes_agreement', 0):.0%} of entries")
    if seg.get("donor"):
        lines.append(f"- donor: {md(seg['donor'], True)} (its {md(seg.get('donor_kind') or 'reference')} reached "
                     f"this request)")
    for f in seg.get("also") or []:  # the segment's other findings, beneath its verdict
        if f.get("verdict") not in ("identical", "numeric_drift"):
            lines.append(f"- also {md(f.get('verdict'), True)} at stage {md(f.get('stage') or '-', True)}: "
                         f"{md(f.get('summary'))}")
    for k, v in (seg.get("evidence") or {}).items() if isinstance(seg.get("evidence"), dict) else []:
        lines.append(f"- {md(k)}: {md(v)}")
    return lines


def issue_text(origin, finding: Finding, case: Case, report: dict, bundle: dict, meta: dict, picture: bool) -> str:
    seg = shown_by(report, finding)
    cand = report.get("candidate") or {}
    versions = cand.get("versions") or {}
    env = [f"- engine: {md(cand.get('engine') or cand.get('label'))}",
           *(f"- {md(k)}: {md(v)}" for k, v in sorted(versions.items()) if v and not isinstance(v, dict)),
           f"- device: {md(cand.get('device') or (cand.get('identity') or {}).get('device') or '?')}",
           "- checkpoints: " + ", ".join(f"{md(k)} {md(str(v)[:12])}" for k, v in sorted(
               ((cand.get("identity") or {}).get("checkpoints") or {}).items()))]
    if versions.get("vllm_omni_mutant"):
        m = versions["vllm_omni_mutant"]
        up = m.get("upstream") or {}
        env.append(f"- a re-created bug: {md(m.get('bug'))} (upstream "
                   + ", ".join(f"{md(k)} #{md(v)}" for k, v in up.items() if v) + f") reverted into {md(m.get('release'))}")
    if case.settings:
        env.append(f"- settings: {', '.join(md(f'{k}={v}') for k, v in case.settings)}")
    serve = []
    if cand.get("deploy_overlay"):
        env.append("- deploy configuration: `deploy-overlay.yaml` (bundled)")
        serve = ["The server, as difftest started it (one per checkpoint type; the model is the checkpoint folder):", "",
                 "```", "vllm serve MODEL --omni --deploy-config deploy-overlay.yaml --host 127.0.0.1 --port PORT",
                 "```", ""]
    reqs = []
    for item in bundle["requests"]:
        b = API_OF_PATH[item.get("path", SpeechApi.path)].row(item["body"])
        voice = (f", reference {md(item['ref_audio_file'], True)}" if item.get("ref_audio_file")
                 else f", voice {md(b['voice'], True)}" if b.get("voice") else "")
        reqs.append(f"| {md(item['id'], True)}{' (target)' if item['id'] == finding.segment else ''}"
                    f"{' (donor)' if item['id'] == finding.donor else ''} | {md(b['task'])} | "
                    f"{md(b['language'] or '-')} | {md(b['text'])}{voice} | {md(b['max_new_tokens'])} |")
    rate = meta.get("rate")
    text = [f"# {md(bundle['title'])}", "",
            "## Symptom", "",
            f"{md(seg.get('summary'))}.", "",
            f"Found by difftest in the run {md(origin.out, True)} (suite {md(origin.suite.name, True)}, "
            f"{len(origin.suite.segments)} segments at concurrency {md(origin.run['concurrency'])}, "
            f"{md(origin.run['pattern'])} arrivals), segment {md(finding.segment, True)}: {md(finding.verdict, True)} "
            f"at {md(finding.stage, True)}" + (f", donor {md(finding.donor, True)}" if finding.donor else "") + ".", "",
            "## Environment", "", *env, "",
            "## Minimal reproduction", "",
            f"{md(case.describe())}; reproduced in {md(rate['reproduced'])} of {md(rate['tries'])} tries"
            + (" (it depends on scheduling)" if rate and rate["reproduced"] < rate["tries"] else "") + "."
            if rate else md(case.describe()) + ".", "",
            "| request | task | language | text | max_new_tokens |", "|---|---|---|---|---|", *reqs, "",
            *serve,
            "```",
            "python3 repro.py --url http://127.0.0.1:PORT   # exit 1: the defect shows; 0: it does not",
            "```", "",
            f"`repro.py` needs only Python's standard library and the server. It compares the target's audio with "
            f"{bundle['against_label']} (`expected/`), chunk by chunk.", "",
            "## Diagnosis (from difftest's capture of what each stage received)", "", *_diagnosis(seg), ""]
    if meta.get("validation"):
        text += ["## Checked", ""]
        for who, code in meta["validation"].items():
            text.append(f"- `repro.py` against {md(who)}: exit {md(code)}")
        text.append("")
    if meta.get("notes"):
        text += ["## Notes", "", *(f"- {md(n)}" for n in meta["notes"]), ""]
    if picture:
        text += ["![the target's spectrogram against the expected one, and the difference](specdiff.png)", ""]
    text += ["The minimal case as a difftest suite: `suite.yaml` (`difftest run suite.yaml --candidate URL`, "
             "`difftest bisect --suite suite.yaml`).", ""]
    return "\n".join(text)

