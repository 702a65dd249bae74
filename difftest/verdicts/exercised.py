"""Was the configuration the candidate was asked to serve the one that ran?

A run configured with async chunks whose requests all reached the vocoder in one piece tested the
full-payload hand-off, not the chunked one: it would pass as if the chunked path had been tested.
So the run says what ran, from the capture (`handoff`, `chunk_frames`, difftest.engines.capture),
and a configuration that did not run is a run-level `error` (exit 3, "configuration not
exercised"), never a pass.

Prefix caching likewise: a run whose servers have it on for a stage must show that stage's cache
was hit (the servers' `vllm:prefix_cache_hits_total`, read before they stop). On the tiny suites it
never is (the smoke suite sent twice, the same four requests: 302 tokens queried, 0 hit): their
prompts fill no cache block, so such a run is no evidence about the cache, and says so.

Concurrency likewise: a run at N > 1 tests cross-request defects (the seed's leak) only where two
requests shared the engine. A one-segment suite, or a client whose requests never overlapped, never
had two in flight: the run says so and is an `error`, never a pass. Two requests were in flight
together when their spans (sent to answered, `meta.in_flight`, the HTTP runner's clock) overlap, or
when one batch held both (`meta.batch`, the offline runner). Where the engine also says how many
requests it batched (`meta.batch_size`, the CPU test engine's header), that is reported, and a run
whose engine batched none together says so in a warning: a server may queue requests it holds
together and run them one at a time (the CPU engine does so with sampled requests, each drawing
from its own generator). vLLM-Omni says nothing of the kind over HTTP (docs/verdicts.md).

Chunked prefill and preemption likewise: production's talker prefills a long prompt over several
512-token steps and preempts requests when its KV cache fills, then resumes them by recomputing
their prompt and generated tokens. The capture plugin records each request's prefill steps and
preemptions from the talker's scheduler; the run reports them (which requests, after how many
tokens), and a run required to take a path (`--require-path`, a gate cell's `exercises`) where no
request took it is an `error`.

Chunked means more than one hand-off for every request longer than one frame: vLLM-Omni's first
chunk is a single frame (its deploy's `initial_chunk`), so any longer request is handed over at
least twice when chunking runs.
"""

from __future__ import annotations

from ..family import SAMPLE_RATE, SAMPLES_PER_FRAME
from ..suites.voices import reference_frames, samples_at_model_rate


def async_chunks(candidate: dict, results: dict) -> dict | None:
    """The finding for async chunking over the candidate's results (segment -> Result), or None
    when the candidate was not configured with it."""
    if not candidate.get("async_chunk"):
        return None
    told = {sid: r for sid, r in results.items() if r.meta.get("handoff")}
    longer = {sid: r for sid, r in told.items() if len(r.codes) > 1}
    whole = sorted(sid for sid, r in longer.items()
                   if r.meta["handoff"] != "async_chunk" or int(r.meta.get("chunks") or 0) < 2)
    untold = sorted(set(results) - set(told))
    out = {"configured": {"async_chunk": True}, "requests": len(results), "said": len(told),
           "chunked": len(longer) - len(whole), "in_one_piece": whole, "not_said": untold}
    if whole:
        out |= {"verdict": "error", "summary": (
            f"configuration not exercised: async_chunk is on, but {len(whole)} of {len(longer)} requests longer "
            f"than a frame reached the vocoder in one hand-off ({', '.join(whole[:5])}"
            f"{', ...' if len(whole) > 5 else ''}): the chunked path did not run")}
    elif untold or not longer:
        out |= {"verdict": "error", "summary": (
            "configuration not exercised: async_chunk is on, but the capture does not say how "
            + (f"{len(untold)} of {len(results)} requests were handed to the vocoder" if untold else
               "any request longer than a frame was handed to the vocoder (none was)")
            + ": nothing shows the chunked path ran")}
    else:
        out |= {"verdict": "pass", "summary": f"async chunks ran: every one of {len(longer)} requests longer than a "
                                              f"frame reached the vocoder in 2 or more hand-offs"}
    return out


def prefix_cache(candidate: dict) -> dict | None:
    """The finding for prefix caching, from the counters run.py read off the servers, or None when
    no stage has it on."""
    stages = candidate.get("prefix_caching_stages") or []
    if not stages:
        return None
    counts = candidate.get("prefix_cache") or {}
    out = {"configured": {"prefix_caching_stages": stages}, "counters": counts}
    if "error" in counts or not counts:
        return out | {"verdict": "error", "summary": (
            f"configuration not exercised: prefix caching is on for stage {', '.join(map(str, stages))}, but the "
            f"servers' cache counters could not be read ({counts.get('error', 'no counters')}): nothing shows it ran")}
    cold = [st for st in stages if counts.get(str(st), {}).get("hits", 0) <= 0]
    if cold:
        c = counts.get(str(cold[0]), {})
        return out | {"verdict": "error", "summary": (
            f"configuration not exercised: prefix caching is on for stage {cold[0]}, but its cache was hit "
            f"{c.get('hits', 0)} times in {c.get('queries', 0)} queried tokens: no request reused a cached prefix "
            f"(a suite whose prompts share prefixes longer than a cache block exercises it)")}
    return out | {"verdict": "pass", "summary": "prefix cache hits: " + ", ".join(
        f"stage {st} {counts[str(st)]['hits']} of {counts[str(st)]['queries']} tokens" for st in stages)}


PATHS = ("chunked_prefill", "preemption")  # what a run can be required to show (--require-path, a gate cell's `exercises`)


def scheduling(passes: dict[str, dict], required: tuple | list = (), counters: dict | None = None,
               unanswered: int = 0) -> dict | None:
    """What the talker's scheduler did, from the capture (`meta.prefill_steps`, `meta.preempted_at`,
    difftest.engines.capture.schedule_meta) over the run's passes (name -> segment -> Result):
    prompts prefilled over several steps, requests preempted and resumed, each named. A path in
    `required` that no request took is an `error` ("configuration not exercised"); None when the
    capture says nothing of scheduling and nothing is required. `counters`: the servers' own
    preemption counters per stage (vllm_omni.preemption_counters), the talker's ("0") held against
    the preemptions the capture names: fewer named than counted is an error (the capture missed one),
    unless `unanswered` requests got no result to name them in (a stage that died mid-request)."""
    told = {name: {sid: r for sid, r in results.items() if "prefill_steps" in r.meta} for name, results in passes.items()}
    if not any(told.values()) and not required:
        return None
    chunked = {f"{name}:{sid}": r.meta["prefill_tokens"] for name, res in told.items() for sid, r in res.items()
               if r.meta["prefill_steps"] > 1}
    preempted = {f"{name}:{sid}": r.meta["preempted_at"] for name, res in told.items() for sid, r in res.items()
                 if r.meta.get("preempted_at")}
    steps = [r.meta["prefill_steps"] for res in told.values() for r in res.values()]
    out = {"requests": sum(len(r) for r in passes.values()), "said": sum(len(r) for r in told.values()),
           "most_prefill_steps": max(steps, default=0), "chunked_prefill": chunked, "preempted": preempted,
           "required": list(required)}
    ran = {"chunked_prefill": bool(chunked), "preemption": bool(preempted)}
    said = [f"chunked prefill: {len(chunked)} prompts over 2 or more steps (up to {out['most_prefill_steps']})"
            if chunked else "every prompt prefilled in one step",
            f"preemption: {len(preempted)} requests preempted and resumed ("
            + ", ".join(f"{k} after {', '.join(map(str, v))} tokens" for k, v in list(preempted.items())[:4])
            + (", ..." if len(preempted) > 4 else "") + ")" if preempted else "no request preempted"]
    counted = ((counters or {}).get("0") or {}).get("preemptions")
    if counters is not None:
        out["server_counted_preemptions"] = counted if counted is not None else counters.get("error", "not reported")
    named = sum(len(v) for v in preempted.values())
    if isinstance(counted, int) and counted > named and unanswered:
        said.append(f"{counted - named} of the server's {counted} preemptions in the {unanswered} requests that got no "
                    f"answer")
    elif isinstance(counted, int) and counted > named:
        return out | {"verdict": "error", "summary": (
            f"the talker's server counted {counted} preemptions, the capture names {named}: a preempted request went "
            f"unrecorded, so what ran cannot be told per request")}
    missing = [p for p in required if not ran[p]]
    if missing:
        why = ("the capture does not say how the talker scheduled any request" if not out["said"] else "; ".join(said))
        return out | {"verdict": "error", "summary": f"configuration not exercised: {' and '.join(missing)} required, "
                                                     f"but no request took that path ({why})"}
    return out | {"verdict": "pass", "summary": "; ".join(said)}


def most_in_flight(results: dict) -> tuple[int, list[str]]:
    """(the most requests in flight at once, the segments whose results say neither span nor batch)."""
    events, untold, most = [], [], 0
    for sid, r in results.items():
        span, batch = r.meta.get("in_flight"), r.meta.get("batch")
        if batch:
            most = max(most, len(batch))
        if span:
            events += [(float(span[0]), 1), (float(span[1]), -1)]
        elif not batch:
            untold.append(sid)
    now = 0
    for _, step in sorted(events):  # an answer at the instant another is sent: not together
        now += step
        most = max(most, now)
    return most, sorted(untold)


def concurrency(asked: int, results: dict, sent: int) -> dict | None:
    """The finding for concurrency over the run's pass at N (segment -> Result; `sent`: how many
    requests it sent), or None at 1 and where no request was answered (the segments' errors say why)."""
    if asked <= 1 or not results:
        return None
    most, untold = most_in_flight(results)
    sizes = [r.meta.get("batch_size") for r in results.values()]
    batched = max(sizes) if all(isinstance(n, int) for n in sizes) else None  # the engine's own word
    out = {"configured": {"concurrency": asked}, "requests": len(results), "most_in_flight": most,
           "engine_most_batched": batched, "not_said": untold}
    if most >= 2:
        return out | {"verdict": "pass", "summary": f"concurrency ran: up to {most} of {len(results)} requests in "
                                                    f"flight together (asked: {asked})"
                                                    + (f"; the engine batched up to {batched}" if batched else "")}
    why = ("the suite has one segment" if sent <= 1
           else f"the results of {len(untold)} requests do not say when they were in flight" if untold
           else "each request was answered before the next was sent")
    return out | {"verdict": "error", "summary": (
        f"configuration not exercised: concurrency {asked} was asked, but no two of {sent} requests were "
        f"in flight together ({why}): a cross-request defect cannot show in this run")}


def unbatched_warning(finding: dict | None) -> list[str]:
    """A warning where requests were in flight together but the engine says it batched none."""
    if not finding or finding.get("engine_most_batched") != 1 or finding["verdict"] != "pass":
        return []
    return [f"concurrency: {finding['most_in_flight']} requests were in flight together, but the engine says it "
            f"ran each in a batch of its own: a defect of batching cannot show in this run"]


def codes_judged(verdicts: list) -> dict | None:
    """No PASS on audio alone: a segment whose codes were not captured and whose audio is not
    qwen-tts's within the audio tiers (`audio_divergence`) could be a numerics difference or any
    defect at all (silence, one answer for every request, audio one sample late); without codes
    nothing tells which. None when every segment was judged on codes."""
    blind = [v.id for v in verdicts if v.verdict == "audio_divergence"]
    uncoded = [v.id for v in verdicts if v.verdict != "error" and "codes" not in v.comparisons]
    if not uncoded:
        return None
    if blind:
        return {"verdict": "error", "segments": blind, "summary": (
            f"nothing judged on codes: the candidate's codes were not captured, and the audio of {len(blind)} of "
            f"{len(verdicts)} segments differs from qwen-tts's beyond the audio tiers ({', '.join(blind[:5])}"
            f"{', ...' if len(blind) > 5 else ''}); without codes a numerics difference and a defect look alike: "
            f"no PASS (capture the codes: --capture-dir, or a vLLM-Omni candidate difftest starts)")}
    return {"verdict": "pass", "segments": [], "summary": (
        f"{len(uncoded)} of {len(verdicts)} segments judged on audio alone (no codes captured): each within the "
        f"audio tiers of qwen-tts's")}


def finding(candidate: dict, passes: dict[str, dict], judged: dict | None = None, required: tuple | list = (),
            unanswered: int = 0) -> dict | None:
    """One run-level finding over what was configured (async chunks over the candidate's passes,
    name -> segment -> Result; prefix caching over the run), what the talker's scheduler did (and
    the paths `required` of it), and what the run could judge (`judged`: name -> the `concurrency`
    and `codes_judged` findings), or None when nothing needs showing."""
    checks = {k: v for k, v in (judged or {}).items() if v is not None}
    each = {name: async_chunks(candidate, results) for name, results in passes.items()}
    each = {k: v for k, v in each.items() if v is not None}
    if each:
        bad = [(k, v) for k, v in each.items() if v["verdict"] != "pass"]
        checks["async_chunk"] = {"verdict": "error" if bad else "pass", "passes": each,
                                 "summary": f"{bad[0][0]}: {bad[0][1]['summary']}" if bad
                                 else next(iter(each.values()))["summary"]}
    cache = prefix_cache(candidate)
    if cache:
        checks["prefix_caching"] = cache
    sched = scheduling(passes, required, candidate.get("preemption_counters"), unanswered)
    if sched:
        checks["scheduling"] = sched
    if not checks:
        return None
    bad = [c for c in checks.values() if c["verdict"] != "pass"]
    return {"verdict": "error" if bad else "pass", "summary": "; ".join(c["summary"] for c in (bad or checks.values())),
            "checks": checks}


def references(segments, passes: dict | None = None) -> dict | None:
    """The references the suite sent (its segments' voices) at their own rate and channels, as
    uploaded (difftest read the header and sent the bytes unchanged), and whether the engines' own
    resampling or mixing down ran: a voice that is not 24 kHz mono must come back, in every pass
    that captured its reference codes (name -> segment -> Result; the encoder's, as the talker's
    prompt got them, where the capture says), as ceil(24 kHz samples / 1920) frames. Frames as if
    its bytes were read at 24 kHz (not resampled, or stereo not mixed down) are an `error`, as is a
    run in which no pass captured the codes of any such voice (nothing shows the path ran). Another
    frame count is left to the segment's verdict (a resampler's length, a reference_encoder
    finding). None when every voice is 24 kHz mono (every suite but cases/suites/resampled.yaml)."""
    voices = {s.voice.id: s.voice for s in segments if getattr(s, "voice", None) is not None}
    listed = {}
    for vid, v in voices.items():
        rate, ch = int(getattr(v, "sample_rate", SAMPLE_RATE)), int(getattr(v, "channels", 1))
        listed[vid] = {"sample_rate": rate, "channels": ch, "frames": v.n_samples, "mode": v.mode,
                       "samples_24k": samples_at_model_rate(v.n_samples, rate),
                       "ref_frames": reference_frames(v.n_samples, rate), "converted": (rate, ch) != (SAMPLE_RATE, 1)}
    if not any(x["converted"] for x in listed.values()):
        return None
    seen, wrong, other = {}, [], []
    for name, results in (passes or {}).items():
        for s in segments:
            r, x = results.get(s.id), listed.get(getattr(s.voice, "id", None))
            if r is None or x is None or not x["converted"]:
                continue
            # the encoder's codes, as the talker's prompt got them (the capture's input, its talker
            # stage), else those handed to the vocoder (a hand-off may have cut or extended them)
            extra = getattr(r, "extra", None) or {}
            codes = next((extra[k] for k in ("input_ref_codes", "talker_ref_codes") if k in extra), r.ref_codes)
            if not len(codes):
                continue
            got = len(codes)
            seen.setdefault(s.voice.id, {})[f"{name}:{s.id}"] = got
            raw = {-(-x["frames"] // SAMPLES_PER_FRAME), -(-x["frames"] * x["channels"] // SAMPLES_PER_FRAME)}
            if got != x["ref_frames"]:
                (wrong if got in raw else other).append(
                    f"{name}:{s.id} ({s.voice.id}, {x['sample_rate']} Hz x{x['channels']}: {got} frames, "
                    f"{x['ref_frames']} once at 24 kHz mono)")
    for vid, got in seen.items():
        listed[vid]["ref_frames_captured"] = got
    conv = [f"{vid} {x['sample_rate']} Hz {'mono' if x['channels'] == 1 else 'stereo'}"
            for vid, x in listed.items() if x["converted"]]
    out = {"voices": listed, "converted": [vid for vid, x in listed.items() if x["converted"]]}
    if wrong:
        return out | {"verdict": "error", "summary": (
            f"configuration not exercised: references not resampled or mixed down: {', '.join(wrong[:4])}"
            f"{', ...' if len(wrong) > 4 else ''}")}
    if not seen:
        return out | {"verdict": "error", "summary": (
            f"configuration not exercised: {len(conv)} references are not 24 kHz mono ({', '.join(conv[:4])}), but no "
            f"pass captured the reference codes of one (in-context voices, a candidate whose codes are captured): "
            f"nothing shows the resampling ran")}
    return out | {"verdict": "pass", "summary": (
        f"references resampled or mixed down by the engines: {len(conv)} of {len(listed)} voices not 24 kHz mono "
        f"({', '.join(conv[:4])}"
        f"{', ...' if len(conv) > 4 else ''}), sent as uploaded; the reference codes of {len(seen)} captured, "
        + (f"{len(other)} of another length than their 24 kHz mono audio's ({', '.join(other[:3])})" if other else
           "each as many frames as their 24 kHz mono audio gives"))}
