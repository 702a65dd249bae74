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

Chunked means more than one hand-off for every request longer than one frame: vLLM-Omni's first
chunk is a single frame (its deploy's `initial_chunk`), so any longer request is handed over at
least twice when chunking runs.
"""

from __future__ import annotations


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


def finding(candidate: dict, passes: dict[str, dict]) -> dict | None:
    """One run-level finding over what was configured (async chunks over the candidate's passes,
    name -> segment -> Result; prefix caching over the run), or None when nothing needs showing."""
    checks = {}
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
    if not checks:
        return None
    bad = [c for c in checks.values() if c["verdict"] != "pass"]
    return {"verdict": "error" if bad else "pass", "summary": "; ".join(c["summary"] for c in (bad or checks.values())),
            "checks": checks}
