"""A hidden install step, found: every Debian package a test's process loads must be on a new
machine already (the base list) or installed by the project's own scripts.

While the tests run, a thread of the pytest process that starts them all reads the files mapped by
every process the tests start (its descendants, and any process carrying the session's mark in its
environment: servers started in their own session, zygote forks), every `INTERVAL` seconds. At the
end each file is traced to its Debian package (dpkg's file lists), and a package that is neither in
the base list nor in `scripts/system-packages.txt` (with what apt installs for those: their
dependencies) fails the session, naming the package, the file and the process. The executables the
project's code calls (argv literals in difftest/ and runners/, commands in scripts/) are checked the
same way. A file of no Debian package (a venv, a wheel, the image's Python) is fine. A process that
lives less than `INTERVAL` is not sampled: the long-lived ones (runners, engines, servers, browsers)
are what load system libraries.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# DIFFTEST_SYSTEM_PACKAGES: another project list (the check's own test uses one without libsndfile1)
PROJECT_LIST = Path(os.environ.get("DIFFTEST_SYSTEM_PACKAGES", ROOT / "scripts" / "system-packages.txt"))
BASE_COPY = ROOT / "tests" / "data" / "debian-base-packages.txt"
BASE_SHARED = ROOT.parent / "shared" / "machine" / "debian-base-packages.txt"
MARK = "DIFFTEST_TEST_SESSION"
INTERVAL = 0.25
REREAD = 1.0
DPKG_INFO = Path("/var/lib/dpkg/info")


def read_list(path: Path) -> set[str]:
    """Package names, one per line (the first word), '#' comments skipped."""
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(line.split()[0])
    return names


def base_list() -> Path:
    """The workplace's list where it lies beside the checkout, else the repository's copy."""
    return BASE_SHARED if BASE_SHARED.exists() else BASE_COPY


# --- dpkg: which package owns a file, and what a package pulls in -----------------------------

_MERGED = ("/bin/", "/sbin/", "/lib/", "/lib32/", "/lib64/", "/libx32/")


def _aliases(path: str):
    """The path and its twin across Debian 12's merged /usr (/lib/x -> /usr/lib/x)."""
    yield path
    if path.startswith("/usr/") and path[4:].startswith(_MERGED):
        yield path[4:]
    elif path.startswith(_MERGED):
        yield "/usr" + path


def file_owners(info: Path = DPKG_INFO) -> dict[str, str]:
    """Every file dpkg installed -> its package (arch qualifier dropped)."""
    owners = {}
    for lst in info.glob("*.list"):
        pkg = lst.name[:-len(".list")].split(":", 1)[0]
        for line in lst.read_text(errors="replace").splitlines():
            for p in _aliases(line):
                owners.setdefault(p, pkg)
    return owners


def owner(path: str, owners: dict[str, str]) -> str | None:
    for p in (path, os.path.realpath(path)):
        for a in _aliases(p):
            if a in owners:
                return owners[a]
    return None


def _dpkg_status(status: Path = Path("/var/lib/dpkg/status")) -> dict[str, dict[str, str]]:
    """Installed packages -> their control fields (Depends, Pre-Depends, Provides)."""
    pkgs = {}
    for stanza in status.read_text(errors="replace").split("\n\n"):
        fields, key = {}, None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += " " + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "installed" in fields.get("Status", "").split() and "Package" in fields:
            pkgs[fields["Package"]] = fields
    return pkgs


def _names(relation: str):
    """'a (>= 1) | b:any, c' -> [['a', 'b'], ['c']]."""
    for group in filter(None, (g.strip() for g in relation.split(","))):
        yield [re.split(r"[\s(:\[]", alt.strip(), maxsplit=1)[0] for alt in group.split("|")]


def with_dependencies(wanted: set[str], status: dict[str, dict[str, str]] | None = None) -> set[str]:
    """The packages and everything installed that they depend on (what apt installs for them)."""
    status = _dpkg_status() if status is None else status
    provides = {}
    for name, fields in status.items():
        for (virtual, *_) in _names(fields.get("Provides", "")):
            provides.setdefault(virtual, []).append(name)
    seen, todo = set(), [w for w in wanted]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fields = status.get(name, {})
        for group in _names(fields.get("Depends", "") + "," + fields.get("Pre-Depends", "")):
            for alt in group:
                todo.extend(n for n in [alt, *provides.get(alt, [])] if n in status)
    return seen


# --- what the tests' processes map -----------------------------------------------------------

@dataclass
class Sampler:
    """Reads the mapped files of the session's processes in a thread: a new process at once, then
    every REREAD seconds while it lives (libraries load as a process imports)."""
    root_pid: int = field(default_factory=os.getpid)
    mark: str = ""
    maps: dict[str, set[str]] = field(default_factory=dict)  # "pid N: argv" -> every file it mapped
    exes: dict[str, set[str]] = field(default_factory=dict)  # "pid N: argv" -> its executables (exec replaces them)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _procs: dict[int, str | None] = field(default_factory=dict)  # pid -> its label, None when not ours
    _read_at: dict[int, float] = field(default_factory=dict)

    def start(self):
        self._thread = threading.Thread(target=self._loop, name="system-packages", daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        self.scan()

    def _loop(self):
        while not self._stop.wait(INTERVAL):
            try:
                self.scan()
            except Exception as e:  # a sampler fault is reported at the end, not lost
                self.errors.append(repr(e))
                return

    def scan(self):
        pids = {int(d) for d in os.listdir("/proc") if d.isdigit()}
        for gone in self._procs.keys() - pids:
            del self._procs[gone]
            self._read_at.pop(gone, None)
        for pid in sorted(pids - self._procs.keys()):  # parents before their children
            label = self._procs[pid] = _label(pid) if self._is_ours(pid) else None
            if label:
                self._exe(pid, label)
        now = time.monotonic()
        for pid, label in list(self._procs.items()):
            if label and now - self._read_at.get(pid, -REREAD) >= REREAD:
                self._read_at[pid] = now
                try:
                    mapped = _MAPPED.findall(Path(f"/proc/{pid}/maps").read_text())
                except OSError:
                    continue
                self._exe(pid, label)  # after the maps: a wrapper script that exec'd (chromium's) is now its program
                self.maps.setdefault(label, set()).update(
                    m for m in mapped if not m.startswith(("/dev/", "/memfd:", "/SYSV")))

    def _exe(self, pid: int, label: str) -> None:
        with contextlib.suppress(OSError):
            self.exes.setdefault(label, set()).add(os.readlink(f"/proc/{pid}/exe"))

    def _is_ours(self, pid: int) -> bool:
        if pid == self.root_pid:
            return True
        try:
            s = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if self._procs.get(int(s[s.rindex(")") + 2:].split()[1])):  # its parent is
            return True
        try:
            return bool(self.mark) and f"{MARK}={self.mark}".encode() in \
                Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return False


def _label(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        argv = []
    return f"pid {pid}: " + " ".join(a.decode(errors="replace") for a in argv if a)[:160]


_MAPPED = re.compile(r" (/[^\n]*?)(?: \(deleted\))?$", re.M)


# --- the executables the project's code calls ------------------------------------------------

_SHELL_WORDS = set("""if then else elif fi for while until do done case esac in function select time
    coproc return exit local declare export readonly unset set shift source eval exec echo printf read
    cd pwd test true false wait kill trap type command builtin let shopt ulimit umask break continue
    mapfile readarray alias hash getopts pushd popd dirs jobs fg bg disown enable help history""".split())
_CALL = re.compile(r"""\[\s*["']([A-Za-z][\w.+-]*)["']\s*,|which\(\s*["']([A-Za-z][\w.+-]*)["']""")


def called_executables(root: Path = ROOT) -> dict[str, str]:
    """Command names the project's code runs -> where: argv literals and which() in difftest/ and
    runners/ (Python), the first word of each command in scripts/ and runners/ (shell)."""
    found = {}
    for py in [*root.glob("difftest/**/*.py"), *root.glob("runners/**/*.py"), *root.glob("scripts/*.py")]:
        text = py.read_text(errors="replace")
        if "subprocess" not in text and "which(" not in text and "exec" not in text:
            continue
        for m in _CALL.finditer(text):
            found.setdefault(m.group(1) or m.group(2), str(py.relative_to(root)))
    for sh in [*root.glob("scripts/*.sh"), *root.glob("runners/**/*.sh"), root / ".ci" / "run"]:
        for word in _shell_commands(sh.read_text(errors="replace")):
            found.setdefault(word, str(sh.relative_to(root)))
    return found


def _shell_commands(text: str):
    funcs = set(re.findall(r"^\s*([\w-]+)\s*\(\)", text, re.M))
    heredoc = None
    for line in text.splitlines():
        line = line.strip()
        if heredoc is not None:  # another language's text (python - <<'EOF' ... EOF)
            heredoc = None if line == heredoc else heredoc
            continue
        if m := re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line):
            heredoc = m.group(1)
        if not line or line.startswith("#"):
            continue
        line = re.sub(r"'[^']*'|\"(?:\\.|[^\"\\])*\"", '""', line)  # quoted text is no command
        for piece in re.split(r"&&|\|\||[;|({`]|\$\(|\bthen\b|\bdo\b|\belse\b|!", line):
            words = piece.split()
            while words and re.match(r"^\w+(\[[^]]*\])?\+?=", words[0]):  # VAR=value prefixes
                words.pop(0)
            if words and re.fullmatch(r"[a-z][\w.+-]*", words[0]) and words[0] not in _SHELL_WORDS | funcs:
                yield words[0]


# --- the judgement -----------------------------------------------------------------------------

@dataclass
class Finding:
    package: str
    file: str
    where: str  # the process that mapped it, or the code that calls it


def read_uses(path: Path) -> dict[str, str]:
    """The project's list: package -> what it is for (`run`: every command's, `test`, ...)."""
    uses = {}
    for line in path.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            uses[words[0]] = words[1] if len(words) > 1 else "run"
    return uses


def hidden_packages(processes: dict[str, set[str]], executables: dict[str, str], *, base: set[str],
                    project: dict[str, str], exes: dict[str, set[str] | str] | None = None,
                    owners: dict[str, str] | None = None,
                    status: dict[str, dict[str, str]] | None = None) -> list[Finding]:
    """One finding per package that a process mapped a file of, or whose executable the code calls,
    and that neither list accounts for (`project`: package -> its use, scripts/system-packages.txt).
    What apt installs with a package counts as installed: with a `run` package (every command
    installs it) in every process; with any other only in that package's own processes, whose
    executable it pulled in (chromium's, its crashpad handler from chromium-common). Chromium pulls
    in libsndfile1 (through libpulse0), but the demo installs no chromium: a reference runner loading
    libsndfile still needs libsndfile1 listed. A process's executable is read when it is first seen,
    its mapped files while it lives (a dependency seen without the library that pulled it in, in a
    snapshot taken while the library loads, is still judged by the rule above). A process's executables
    are every one it was seen running: a wrapper script exec's its program under the same pid."""
    owners = file_owners() if owners is None else owners
    status = _dpkg_status() if status is None else status
    pulled = {p: with_dependencies({p}, status) for p in project}
    everywhere = base.union(project, *(pulled[p] for p, use in project.items() if use == "run"))
    out: dict[str, Finding] = {}

    def judge(files, allowed, where):
        for path in sorted(files):
            pkg = owner(path, owners)
            if pkg and pkg not in allowed and pkg not in out:
                out[pkg] = Finding(pkg, path, where)

    for label, files in sorted(processes.items()):
        ran = (exes or {}).get(label) or set()
        progs = {owner(e, owners) for e in ([ran] if isinstance(ran, str) else ran)} - {None}
        judge(files, everywhere.union(*(pulled[p] for p in project if progs & pulled[p])), label)
    for name, where in sorted(executables.items()):
        if exe := shutil.which(name):
            judge([exe], base | set(project), f"called by {where}")
    return sorted(out.values(), key=lambda f: f.package)


def explain(findings: list[Finding]) -> str:
    lines = [f"{len(findings)} Debian package(s) the tests used are on no new machine and no script of "
             "the project installs them (add each to scripts/system-packages.txt, or stop needing it):"]
    lines += [f"  {f.package}: {f.file} ({f.where})" for f in findings]
    lines.append(f"base list: {base_list()}; project list: {PROJECT_LIST}")
    return "\n".join(lines)


# --- the session's check (hooks imported by tests/conftest.py) -----------------------------------

NODEID = "tests/system_packages.py::every_package_the_session_loaded_is_installed_by_the_project"


def pytest_configure(config):
    """In the process that runs or hands out the tests (not in an xdist worker): mark the session's
    processes and start sampling before any test starts one."""
    if hasattr(config, "workerinput") or not DPKG_INFO.is_dir():
        return
    mark = os.environ.setdefault(MARK, f"{os.getpid()}-{time.time_ns()}")
    config._system_packages = Sampler(mark=mark)
    config._system_packages.start()


def pytest_sessionfinish(session, exitstatus):
    """One more test result: failed, naming each hidden package, or passed."""
    sampler = getattr(session.config, "_system_packages", None)
    if sampler is None:
        return
    from _pytest.reports import TestReport

    sampler.stop()
    started = time.monotonic()
    findings = hidden_packages(sampler.maps, called_executables(), base=read_list(base_list()),
                               project=read_uses(PROJECT_LIST), exes=sampler.exes)
    problems = explain(findings) if findings else ""
    if sampler.errors:
        problems += "\nthe sampler stopped: " + "; ".join(sampler.errors)
    report = TestReport(NODEID, (NODEID.split("::")[0], None, NODEID.split("::")[1]), {},
                        "failed" if problems else "passed", problems or None, "call",
                        duration=time.monotonic() - started)
    session.config.hook.pytest_runtest_logreport(report=report)
    if problems and session.exitstatus == 0:
        session.exitstatus = 1
