"""Whether a URL candidate's kept results may be reused: the server at a URL is whatever answers there
now. A build redeployed behind the same URL, saying the same version, made every result of a second
run into the same --out 'cached' and the run passed without a request sent (issue 56). So before a
run reuses results a URL candidate made earlier:

- the server must say something of itself (GET /version): one that says nothing cannot be told
  from another behind the same URL, and its results are reused only with --reuse-unidentified;
- one wave of the kept results is served again, as it was served (the same requests together),
  and must come back the same: the same codes where they were captured, else the same audio
  sample for sample. A server that answers the same wave otherwise is not the one that made the
  results (a leak at concurrency shows here: the wave is served at N). Anything else is refused,
  exit 2, and --replace judges the server anew.

Engines difftest starts itself are identified by what they are (engines/identity.py), not checked here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from ..errors import BadInput
from .http import cached_results, recorded_waves


def check(candidate, segments: list, folders: dict, identity: dict, url: str, allow_unidentified: bool) -> None:
    """`folders`: pass -> (folder of its results, identity key), the pass at N first. Raises BadInput
    when kept results may not be reused; serves one wave again where they may."""
    for folder, key in folders.values():
        kept = cached_results(segments, folder, key)
        if not kept:
            continue
        if not (identity.get("server") or {}).get("version") and not allow_unidentified:
            raise BadInput(f"{folder} holds results of {url}, which says nothing of itself (no GET /version): "
                           f"another server behind the same URL could not be told from it. --replace judges it "
                           f"anew; --reuse-unidentified reuses them once a wave of them is served again alike")
        _served_alike(candidate, segments, folder, kept, url)
        return  # one wave, of the first pass that kept any: the pass at N where it did


def _served_alike(candidate, segments: list, folder: Path, kept: dict, url: str) -> None:
    wave = recorded_waves(kept.values(), set(kept))[0]
    again = folder.parent / f"{folder.name}-recheck"
    shutil.rmtree(again, ignore_errors=True)
    try:
        by_id = {s.id: s for s in segments}
        fresh = candidate.generate([by_id[sid] for sid in wave], concurrency=len(wave), out_dir=again,
                                   identity_key="recheck")
        for sid in wave:
            why = _differs(kept[sid], fresh.results.get(sid), fresh.errors.get(sid))
            if why:
                raise BadInput(f"{folder}: the server at {url} is not the one whose results are kept there: the "
                               f"wave {', '.join(wave)} served again answers otherwise ({sid}: {why}). --replace "
                               f"judges it anew")
    finally:
        shutil.rmtree(again, ignore_errors=True)


def _differs(kept, fresh, error) -> str | None:
    if fresh is None:
        return f"no answer now ({(error or {}).get('message', 'no result')})"
    if kept.has_codes and fresh.has_codes:
        for name in ("codes", "ref_codes"):
            a, b = getattr(kept, name), getattr(fresh, name)
            if a.shape != b.shape or not np.array_equal(a, b):
                return f"other {name.replace('_', ' ')}" + (f" ({len(a)} frames then, {len(b)} now)"
                                                           if len(a) != len(b) else "")
        return None
    if kept.wav.shape != fresh.wav.shape:
        return f"{len(kept.wav)} samples then, {len(fresh.wav)} now"
    if not np.array_equal(kept.wav, fresh.wav):
        return f"other audio from sample {int(np.flatnonzero(kept.wav != fresh.wav)[0])}"
    return None
