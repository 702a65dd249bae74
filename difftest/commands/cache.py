"""`difftest cache list|clean`: what difftest keeps on disk (difftest/cache.py)."""

from __future__ import annotations

import argparse
import json
import sys

from ..cache import DEFAULT_MAX_ENTRIES, FORMAT, KINDS, MAX_BYTES_ENV, MAX_ENTRIES_ENV, ROOT_ENV, Cache, human, iso_time
from ..checkout import REPO


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number (0 or more), got {text!r}")
    return int(text)


def _days(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of days (0 or more), got {text!r}")
    return v


def cmd_cache_list(args) -> int:
    cache = Cache()
    entries = sorted(cache.entries(args.kind), key=lambda e: (e.kind, e.key))
    total = sum(e.size_bytes for e in entries)
    if args.json:
        print(json.dumps({"format": FORMAT, "root": str(cache.root), "limits": cache.limits.to_json(),
                          "total_bytes": total, "entries": [e.to_json() for e in entries]}, indent=1, sort_keys=True))
        return 0
    if entries:
        rows = [("KIND", "KEY", "SIZE", "LAST USED", "STATE", "PATH")]
        for e in entries:
            state = "in use" if e.in_use else ("ready" if e.complete else "incomplete")
            rows.append((e.kind, e.key, human(e.size_bytes), iso_time(e.last_used), state, str(e.path)))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    print(f"{len(entries)} entries, {human(total)} in {cache.root} (bound: {cache.bound_text()})")
    old = REPO / ".cache" / "handoff"
    if old.is_dir():
        print(f"note: {old} (hand-off environments before difftest's cache) is no longer used; remove it "
              f"with rm -rf", file=sys.stderr)
    return 0


def cmd_cache_clean(args) -> int:
    cache = Cache()
    result = cache.clean(kind=args.kind, everything=args.all, keep=args.keep, older_than_days=args.older_than)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=True))
        return 0
    for e in result["removed"]:
        print(f"removed {e['kind']} {e['key']} ({human(e['size_bytes'])})")
    for e in result["kept_in_use"]:
        print(f"kept {e['kind']} {e['key']}: in use by a running process")
    left = result["remaining"]
    print(f"freed {human(result['freed_bytes'])}; {left['entries']} entries, {human(left['bytes'])} left in "
          f"{result['root']}")
    return 0


def add_cache_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "cache", help="list or remove difftest's cached environments and builds (docs/caches.md)",
        description=f"Entries under ${ROOT_ENV} (default <difftest checkout>/.cache/difftest). Bound: "
                    f"${MAX_BYTES_ENV} (default 10G), ${MAX_ENTRIES_ENV} (default {DEFAULT_MAX_ENTRIES}); "
                    f"least recently used entries go first, entries in use are never removed.")
    sub = p.add_subparsers(dest="cache_command", required=True, metavar="list|clean")
    ls = sub.add_parser("list", help="every entry: kind, key, size, last use, path")
    ls.add_argument("--kind", choices=list(KINDS), help="only this kind")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(func=cmd_cache_list)
    cl = sub.add_parser("clean", help="remove entries (default: only what exceeds the bound)",
                        description="Removes entries nobody is using. Without --all, --keep or --older-than it "
                                    "removes least recently used entries until the cache is within its bound.")
    cl.add_argument("--kind", choices=list(KINDS), help="only entries of this kind")
    which = cl.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every entry")
    which.add_argument("--keep", type=_count, metavar="N", help="all but the N most recently used")
    which.add_argument("--older-than", type=_days, metavar="DAYS", help="entries last used more than DAYS ago")
    cl.add_argument("--json", action="store_true", help="machine-readable output")
    cl.set_defaults(func=cmd_cache_clean)
    return p
