"""Probes: one `Case` served to the live candidate as a short `difftest run`, cached.

    origin = Origin.load(OUT)                        # the run a finding came from
    with Live(origin, stack, log_dir) as live:       # its candidate, started again on first need
        prober = Prober(origin, target, work, policy, runner, live)
        prober(case)                                 # True: the target still shows the finding

A probe writes its case as a suite (`suite.yaml` with the voices it needs, a valid suite that
`difftest run` and `difftest bisect --suite` take) and runs it with the reference runner shared by
all probes, into `probes/<key>/`. Its key holds the case and everything that made the result:
the run's engine identity, the policy, the suite's segments. A probe whose `outcome.json` exists
is read, never run again: an interrupted `difftest repro` resumes where it stopped, and a fully
cached one starts no engine.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from ..engines.reference import ReferenceOptions, reference_python
from ..engines.start import CPU_ENGINE, VLLM_OMNI, CandidateSpec, Setup, start_candidate
from ..errors import BadInput, InfraError
from ..results import atomic_write
from ..suites import wavio
from ..suites.suite import Segment, Suite, content_hash, load_suite
from ..verdicts.catalogue import BY_NAME, SEGMENT_VERDICTS
from .shrink import Case

JUDGE = 2  # how a probe's outcome is read from its report; a change makes earlier outcomes stale
CONCURRENCY_FREE = tuple(v for v in SEGMENT_VERDICTS if not BY_NAME[v].fails)  # a segment at 1 with one: nothing failed


@dataclass
class Finding:
    """What the run said about one segment, and what a probe must keep showing."""

    segment: str
    verdict: str
    stage: str | None
    donor: str | None
    donor_kind: str | None
    chunk: int | None
    summary: str
    at_one: str | None  # the same segment's verdict at concurrency 1 alone
    wave: list  # the requests that shared its wave, in the order sent

    @property
    def needs_concurrency(self) -> bool:
        return self.donor is not None or (self.at_one in CONCURRENCY_FREE and self.verdict not in CONCURRENCY_FREE)

    def matches_swapped(self, seg: dict | None) -> bool:
        """The donor's own segment shows the same finding, with the target as its donor."""
        return bool(seg) and seg["verdict"] == self.verdict and seg.get("stage") == self.stage and (
            seg.get("donor") == self.segment)

    def matches(self, seg: dict | None) -> bool:
        return bool(seg) and seg["verdict"] == self.verdict and seg.get("stage") == self.stage and (
            self.donor is None or seg.get("donor") == self.donor)


@dataclass
class Origin:
    out: Path
    run: dict  # run.json
    report: dict  # report.json
    suite: Suite

    @classmethod
    def load(cls, out: Path) -> "Origin":
        out = Path(out)
        try:
            run = json.loads((out / "run.json").read_text())
            report = json.loads((out / "report.json").read_text())
        except FileNotFoundError as e:
            raise BadInput(f"{out}: not a finished run folder ({Path(e.filename).name} missing)") from None
        except ValueError as e:
            raise BadInput(f"{out}: run.json or report.json is not JSON ({e})") from None
        if "replay" not in run:
            raise BadInput(f"{out}/run.json: made by a difftest without the replay record; run it again to "
                           f"reproduce its findings")
        suite = load_suite(run["suite"])
        if suite.hash != run["suite_hash"]:
            raise BadInput(f"{run['suite']}: changed since the run at {out} (its hash differs); repro needs the "
                           f"suite as it ran")
        return cls(out, run, report, suite)

    def failing(self) -> list[str]:
        return list(self.report.get("failing") or [])

    def finding(self, sid: str) -> Finding:
        segs = {s["id"]: s for s in self.report["segments"]}
        if sid not in segs:
            raise BadInput(f"segment {sid!r}: not in the run at {self.out} (its segments: {', '.join(segs)})")
        s = segs[sid]
        if sid not in self.failing():
            raise BadInput(f"segment {sid!r}: {s['verdict']} in the run at {self.out}, not a failure to reproduce "
                           f"(failing: {', '.join(self.failing()) or 'none'})")
        at_one = {x["id"]: x["verdict"] for x in self.report.get("at_concurrency_1", {}).get("segments", [])}
        batches = self.report["candidate"].get("batches") or [[x.id for x in self.suite.segments]]
        wave = next((b for b in batches if sid in b), [sid])
        return Finding(sid, s["verdict"], s.get("stage"), s.get("donor"), s.get("donor_kind"),
                       s.get("first_divergent_chunk"), s.get("summary") or "", at_one.get(sid), list(wave))

    @property
    def spec(self) -> CandidateSpec:
        return CandidateSpec.from_json(self.run["replay"]["spec"])

    @property
    def mutant(self) -> dict | None:
        return ((self.run.get("engine") or {}).get("versions") or {}).get("vllm_omni_mutant")

    def run_options(self, store: Path | None = None):
        from ..run import RunOptions

        rp = self.run["replay"]
        ref = rp["reference"]
        return RunOptions(concurrency=self.run["concurrency"], pattern=self.run["pattern"], order=self.run["order"],
                          voice_mode=rp["voice_mode"], store=Path(store or self.run["store"]),
                          reference=ReferenceOptions(models=list(self.run["models"]), python=ref["python"],
                                                     device=ref["device"], dtype=ref["dtype"]),
                          vllm_omni=dict(rp["vllm_omni"] or {}), repeat=rp["repeat"],
                          candidate_dtype=rp["candidate_dtype"],
                          candidate_vocoder_dtype=rp.get("candidate_vocoder_dtype"), replace=True)


def write_suite(origin: Suite, case: Case, folder: Path, name: str, copy_voices: bool = False) -> Path:
    """The case as a suite file in `folder` (its voices cut or copied beside it where needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    segs = [origin.segment(s) for s in case.segments]
    voices, used = [], {}
    for seg in segs:
        v = seg.voice
        if v is None or v.id in used:
            continue
        samples = case.edit(v.id, "ref_samples")
        wav = v.wav
        if samples is not None or copy_voices:
            wav = folder / "voices" / (f"{v.id}.wav" if samples is None else f"{v.id}-{samples}.wav")
            wav.parent.mkdir(exist_ok=True)
            if samples is None:
                shutil.copyfile(v.wav, wav)
            else:
                atomic_write(wav, wavio.head(v.wav.read_bytes(), samples))
        used[v.id] = wav
        voices.append({"id": v.id, "wav": str(wav.relative_to(folder)) if wav.is_relative_to(folder) else str(wav),
                       "transcript": v.transcript, "mode": v.mode})
    tokens = case.edit("*", "max_new_tokens")
    segments = []
    for seg in segs:
        item = {"id": seg.id, "text": case.edit(seg.id, "text") or seg.text, "language": seg.language,
                "task": seg.task}
        for k in ("speaker", "instructions"):
            if getattr(seg, k):
                item[k] = getattr(seg, k)
        if seg.voice:
            item["voice"] = seg.voice.id
        item["decode"] = {**seg.decode, **({"max_new_tokens": min(tokens, seg.decode["max_new_tokens"])}
                                           if tokens else {})}
        segments.append(item)
    doc = {"name": name, "description": f"{case.describe()} (difftest repro, from {origin.name})",
           "model": origin.model, "decode": {k: origin.decode[k] for k in ("repetition_penalty", "max_new_tokens",
                                                                          "seed")},
           "chunks": dict(origin.chunks), "voices": voices, "segments": segments}
    path = folder / "suite.yaml"
    atomic_write(path, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode())
    return path


class Live:
    """The run's candidate, started again for the probes: one engine per settings, on first need,
    stopped when the stack closes. A mutant of the bug corpus is rebuilt from its entry."""

    def __init__(self, origin: Origin, stack: ExitStack, work: Path, stream=sys.stderr):
        self.origin, self.stack, self.work, self.stream = origin, stack, work, stream
        self.engines: dict[tuple, tuple] = {}
        self.python_override: str | None = None

    def spec(self, settings: tuple, clean: bool = False) -> CandidateSpec:
        spec = self.origin.spec
        options = {k: json.loads(v) for k, v in settings}
        spec = replace(spec, options=options)
        if clean:  # the control: the same engine without the defect (the release under a mutant, the clean CPU engine)
            if spec.is_.planted_defects:
                return replace(spec, defect=None)
            if self.origin.mutant:
                return replace(spec, python=self.origin.mutant["base_python"])
            return None
        mutant = self.origin.mutant
        if mutant and not (spec.python and Path(spec.python).exists()):
            spec = replace(spec, python=self._rebuild(mutant))
        return spec

    def _rebuild(self, mutant: dict) -> str:
        if self.python_override is None:
            from ..bugs.corpus import DEFAULT_CORPUS, load_corpus
            from ..bugs.mutant import mutant_env

            entries = load_corpus(DEFAULT_CORPUS, [mutant["bug"]])
            self.python_override = str(self.stack.enter_context(
                mutant_env(entries[0], Path(mutant["base_python"]), self.work / "logs" / "mutant-build.log")))
        return self.python_override

    @property
    def stateful(self) -> bool:
        """The candidate keeps state across requests that can change an answer (a prefix cache): a
        probe served after others may show what a fresh server would not, so each probe gets a
        fresh engine."""
        return bool((self.origin.report.get("candidate") or {}).get("prefix_caching_stages"))

    def engine(self, settings: tuple, suite: Suite, opts, clean: bool = False, fresh: bool = False):
        """(spec, started engine) for these settings; started once and kept for every later probe,
        or started anew (`fresh`, the earlier one stopped)."""
        key = (settings, clean)
        if fresh and key in self.engines:
            self.engines.pop(key)[2].close()
        if key not in self.engines:
            spec = self.spec(settings, clean)
            if spec is None:
                raise BadInput("no clean control for this candidate (a URL, or a release that carries the bug)")
            if not spec.is_.started_here:
                self.engines[key] = (spec, None, ExitStack())  # run() reaches it each time
            else:
                what = "the clean control" if clean else spec.label
                print(f"repro: starting {what}" + (f" with {dict(settings)}" if settings else ""), file=self.stream,
                      flush=True)
                python = reference_python(opts.reference.python)
                folder = self.work / "engines" / content_hash([settings, clean])[:12]
                setup = Setup(folder, list(opts.reference.models), python, suite, opts)
                own = ExitStack()  # stopped with the whole (self.stack), or alone for a fresh one
                self.stack.callback(own.close)
                try:
                    engine = start_candidate(spec, setup, own, run_tag="repro")
                except InfraError as e:
                    own.close()
                    raise InfraError(f"{what} did not start again for the probes: {e}") from None
                self.engines[key] = (spec, engine, own)
        return self.engines[key][:2]


class Prober:
    """probe(case) -> whether the target still shows the finding; each probe's folder kept."""

    def __init__(self, origin: Origin, finding: Finding, work: Path, policy, runner, live: Live, opts,
                 stream=sys.stderr):
        self.origin, self.finding, self.work, self.policy = origin, finding, work, policy
        self.runner, self.live, self.opts, self.stream = runner, live, opts, stream
        self.log: list[dict] = []

    def key(self, case: Case, clean: bool = False) -> str:
        return content_hash({"judge": JUDGE, "case": case.key(), "engine": self.origin.run["engine"], "clean": clean,
                             **({"fresh": True} if self.live.stateful else {}),
                             "policy": self.policy.as_dict(), "suite": self.origin.suite.hash,
                             "finding": [self.finding.segment, self.finding.verdict, self.finding.stage,
                                         self.finding.donor]})[:16]

    def folder(self, case: Case, clean: bool = False) -> Path:
        return self.work / "probes" / self.key(case, clean)

    def outcome(self, case: Case, clean: bool = False) -> dict:
        d = self.folder(case, clean)
        try:
            done = json.loads((d / "outcome.json").read_text())
            self.log.append({**done, "cached": True})
            return done
        except (FileNotFoundError, ValueError):
            pass
        from ..run import run

        t0 = time.perf_counter()
        origin_voices = frozenset(v.wav for v in self.origin.suite.voices.values())  # the origin's own, allowed there
        suite = load_suite(write_suite(self.origin.suite, case, d, f"{self.origin.suite.name}-probe"), also=origin_voices)
        # a finding of the history check needs the repeat serving; every other probe is shorter without it
        opts = replace(self.opts, concurrency=case.concurrency, pattern=case.pattern, order=case.order,
                       repeat=self.finding.verdict == "history_defect",
                       vllm_omni={**self.opts.vllm_omni, "max_num_seqs": max(self.origin.run["concurrency"], 1)})
        spec, engine = self.live.engine(case.settings, suite, opts, clean, fresh=self.live.stateful)
        if engine is not None and hasattr(engine, "pattern"):
            engine.pattern, engine.order, engine.run_tag = case.pattern, case.order, f"repro{self.key(case)[:6]}"
        n = len(self.log) + 1
        print(f"repro: probe {n}: {case.describe()}" + (" [clean control]" if clean else ""), file=self.stream,
              flush=True)
        report = run(suite, spec, d / "run", self.policy, opts, runner=self.runner, candidate=engine)
        segs = {s["id"]: s for s in report["segments"]}
        seg = segs.get(self.finding.segment)
        # a leak between two requests may run either way: which one's reference is the last written
        # depends on the order the engine takes them in; the donor taking the target's is the same defect
        swapped = self.finding.donor is not None and not self.finding.matches(seg) and self.finding.matches_swapped(
            segs.get(self.finding.donor))
        if swapped:
            seg = segs[self.finding.donor]
        done = {"reproduced": report["verdict"] == "fail" and (swapped or self.finding.matches(seg)),
                "swapped": swapped,
                "verdict": seg and seg["verdict"], "stage": seg and seg.get("stage"), "donor": seg and seg.get("donor"),
                "run_verdict": report["verdict"], "case": case.describe(), "key": self.key(case, clean),
                "seconds": round(time.perf_counter() - t0, 1)}
        atomic_write(d / "outcome.json", json.dumps(done, indent=1, sort_keys=True).encode())
        self.log.append({**done, "cached": False})
        print(f"repro: probe {n}: {'reproduced' if done['reproduced'] else 'not reproduced'}"
              f"{' (the other way round)' if swapped else ''} "
              f"({done['verdict']}@{done['stage'] or '-'}{' from ' + done['donor'] if done['donor'] else ''}, "
              f"{done['seconds']:.0f} s)", file=self.stream, flush=True)
        return done

    def __call__(self, case: Case) -> bool:
        return self.outcome(case)["reproduced"]


def opts_for(origin: Origin, store: Path | None):
    opts = origin.run_options(store)
    if origin.spec.is_.one_batch_per_wave and opts.pattern != "barrier":
        opts = replace(opts, pattern="barrier")
    return opts


__all__ = ["CPU_ENGINE", "VLLM_OMNI", "Finding", "Live", "Origin", "Prober", "Segment", "opts_for", "write_suite"]
