"""`difftest compare`: verdicts for two result sets someone already has."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import BadInput
from ..records.report import build_report
from ..results import load_result_set
from ..verdicts import exercised
from ..verdicts.classify import Evidence, classify, talker_stage
from ..verdicts.policy import Policy
from ..verdicts.talker_input import inputs_of


def _load(path: str | Path, what: str):
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"{what} {p}: not a directory of results")
    results, warnings = load_result_set(p)
    if not results:
        raise BadInput(f"{what} {p}: holds no valid results" + (f" ({warnings[0]})" if warnings else ""))
    return results, warnings


def _label(results: dict) -> dict:
    first = next(iter(results.values()))
    return {"label": first.meta.get("runner", "unknown"), "provenance": first.provenance,
            "concurrency": first.meta.get("concurrency")}


def compare_result_sets(reference_dir, candidate_dir, policy: Policy, *, control_dir=None,
                        initial_frames: int = 1, chunk_frames: int = 25) -> dict:
    """Pair results by segment id and classify each; returns report.json's content."""
    refs, w1 = _load(reference_dir, "reference set")
    cands, w2 = _load(candidate_dir, "candidate set")
    ctrls, w3 = _load(control_dir, "control set") if control_dir else ({}, [])
    warnings = w1 + w2 + w3
    # Each segment's own reference codes, to recognise a co-batched request's in another's
    # capture; which requests shared a batch is unknown here, so every other segment is a peer.
    stages = {sid: t for sid, r in cands.items() if (t := talker_stage(r)) is not None}
    own_ref = {sid: stages[sid].ref_codes if sid in stages else (ctrls.get(sid) or refs[sid]).ref_codes
               for sid in refs}
    verdicts = []
    for sid in sorted(set(refs) | set(cands)):
        ev = Evidence(segment_id=sid, reference=refs.get(sid), candidate=cands.get(sid), control=ctrls.get(sid),
                      peer_ref_codes={p: rc for p, rc in own_ref.items() if p != sid},
                      peer_tokens={p: t.tokens for p, t in stages.items() if p != sid},
                      other_inputs={p: i for p, r in refs.items() if p != sid and (i := inputs_of(r)) is not None},
                      initial_frames=initial_frames, chunk_frames=chunk_frames)
        if sid in refs and sid in cands and refs[sid].segment_hash != cands[sid].segment_hash:
            warnings.append(f"{sid}: reference and candidate were made from different segment contents "
                            f"({refs[sid].segment_hash[:12]} vs {cands[sid].segment_hash[:12]})")
        for name, r in (("reference", ev.reference), ("candidate", ev.candidate)):
            if r is None:
                ev.errors.append({"source": name, "kind": "bad_input",
                                  "message": f"segment {sid} has no {name} result"})
        verdicts.append(classify(ev, policy))
    return build_report(verdicts, policy, reference=_label(refs), candidate=_label(cands),
                        concurrency=next(iter(cands.values())).meta.get("concurrency"),
                        warnings=policy.warnings() + warnings,
                        configuration=exercised.finding({}, {}, {"codes": exercised.codes_judged(verdicts)}))


def _chunks(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
        if a <= 0 or b <= 0:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INITIAL,FRAMES (positive integers), got {text!r}") from None
    return a, b


def cmd_compare(args) -> int:
    from ..records.report import summary_lines, write_report
    from ..verdicts.policy import load_policy

    policy = load_policy(args.policy)
    report = compare_result_sets(args.reference, args.candidate, policy, control_dir=args.control,
                                 initial_frames=args.chunks[0], chunk_frames=args.chunks[1])
    path = write_report(args.out, report)
    _print_summary(summary_lines(report), path, args)
    return report["exit_code"]


def _print_summary(lines, path, args):
    if getattr(args, "json", False):
        print(json.dumps({"report": str(path)}))
    else:
        print("\n".join(lines))
        print(f"report: {path}")


def add_compare_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("compare", help="compare two result sets and write report.json")
    c.add_argument("reference", help="directory of reference results")
    c.add_argument("candidate", help="directory of candidate results (at concurrency N)")
    c.add_argument("--control", help="directory of candidate results at concurrency 1")
    c.add_argument("--out", required=True, help="where report.json and summary.md go")
    c.add_argument("--policy", help="policy YAML (default: the built-in difftest/verdicts/default_policy.yaml)")
    c.add_argument("--chunks", type=_chunks, default=(1, 25), metavar="INITIAL,FRAMES",
                   help="the candidate's chunk schedule in frames (default 1,25)")
    c.add_argument("--json", action="store_true", help="print only the report path as JSON")
    c.set_defaults(func=cmd_compare)
    return c
