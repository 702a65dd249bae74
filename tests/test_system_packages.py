"""The check that finds a hidden install step (tests/system_packages.py): real processes, dpkg's own
records, the project's real lists."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import system_packages as sp

ROOT = Path(__file__).resolve().parent.parent
SOUNDFILE = "import soundfile, sys; print('ready', flush=True); sys.stdin.read()"


def _sampled(code: str) -> dict[str, set[str]]:
    """What a sampler reads of a real process once it said it is ready (no timing relied on)."""
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        sampler = sp.Sampler(root_pid=p.pid, mark="")  # that process alone
        sampler.scan()
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    return sampler.maps


def test_a_library_a_process_loads_is_traced_to_its_package():
    seen = _sampled("import ctypes, sys; ctypes.CDLL('libz.so.1'); print('ready', flush=True); sys.stdin.read()")
    [(label, files)] = seen.items()
    assert "-c import ctypes" in label  # the process that mapped it is named
    libz = [f for f in files if "/libz.so" in f]
    assert sp.owner(libz[0], sp.file_owners()) == "zlib1g"
    base = sp.read_list(sp.base_list())
    assert "zlib1g" in base and sp.hidden_packages(seen, {}, base=base, project={}) == []
    found = sp.hidden_packages(seen, {}, base=base - {"zlib1g"}, project={})
    assert [f.package for f in found] == ["zlib1g"] and "/libz.so" in found[0].file and found[0].where == label


def test_libsndfile_without_the_project_list_is_named():
    """soundfile loads the system's libsndfile: the project's list must carry libsndfile1 (issue 61)."""
    seen = _sampled(SOUNDFILE)
    base, project = sp.read_list(sp.base_list()), sp.read_uses(sp.PROJECT_LIST)
    assert "libsndfile1" not in base and project["libsndfile1"] == "run" and project["chromium"] == "test"
    assert sp.hidden_packages(seen, {}, base=base, project=project) == []
    without = {k: v for k, v in project.items() if k != "libsndfile1"}  # chromium still pulls it in
    found = sp.hidden_packages(seen, {}, base=base, project=without)
    # libsndfile1 itself, and the codecs apt installs with it (not in the base list either)
    names = {f.package for f in found}
    assert "libsndfile1" in names and names <= sp.with_dependencies({"libsndfile1"}), names
    assert {"libflac12", "libopus0", "libvorbisenc2"} <= sp.with_dependencies({"libsndfile1"})


def test_dependencies_of_a_listed_package_are_allowed():
    status = {
        "a": {"Depends": "b (>= 1) | c, d:any", "Provides": ""},
        "b": {"Depends": "", "Pre-Depends": "e"},
        "d": {"Depends": "virtual-x"},
        "e": {}, "f": {"Provides": "virtual-x (= 2)"}, "unrelated": {},
    }
    assert sp.with_dependencies({"a"}, status) == {"a", "b", "d", "e", "f"}


def test_what_a_listed_package_pulls_in_counts_only_in_that_package_s_processes():
    """chromium pulls in libsndfile1 (through libpulse0) and chromium-common (its crashpad handler,
    a process of its own that maps no file of chromium's): the handler passes, but a reference
    runner that loads libsndfile still needs libsndfile1 listed, the demo installing no chromium."""
    status = {"chromium": {"Depends": "chromium-common, libpulse0"}, "chromium-common": {},
              "libpulse0": {"Depends": "libsndfile1"}, "libsndfile1": {}}
    owners = {"/usr/lib/chromium/chrome_crashpad_handler": "chromium-common",
              "/usr/lib/x86_64-linux-gnu/libsndfile.so.1.0.35": "libsndfile1"}
    handler = "pid 2: /usr/lib/chromium/chrome_crashpad_handler --monitor-self"
    runner = "pid 3: .venv-reference/bin/python -m runners.reference"
    processes = {handler: {"/usr/lib/chromium/chrome_crashpad_handler"},
                 runner: {"/usr/lib/x86_64-linux-gnu/libsndfile.so.1.0.35"}}
    exes = {handler: "/usr/lib/chromium/chrome_crashpad_handler", runner: "/work/.venv-reference/bin/python3"}
    found = sp.hidden_packages(processes, {}, base=set(), project={"chromium": "test"}, exes=exes, owners=owners,
                               status=status)
    assert [(f.package, f.where) for f in found] == [("libsndfile1", runner)]
    found = sp.hidden_packages(processes, {}, base=set(), project={"chromium": "test"}, owners=owners, status=status)
    assert {f.package for f in found} == {"libsndfile1", "chromium-common"}  # without its executable, no telling
    # a package every command installs counts with what it pulls in everywhere: a snapshot of the
    # runner taken while libsndfile loads may hold its codecs and not yet libsndfile itself
    status.update(libsndfile1={"Depends": "libflac12"}, libflac12={})
    owners["/usr/lib/x86_64-linux-gnu/libFLAC.so.12.0.0"] = "libflac12"
    processes[runner] = {"/usr/lib/x86_64-linux-gnu/libFLAC.so.12.0.0"}
    found = sp.hidden_packages(processes, {}, base=set(), project={"chromium": "test", "libsndfile1": "run"},
                               exes=exes, owners=owners, status=status)
    assert found == []


def test_a_wrapper_script_that_execs_its_program_is_judged_by_every_executable_it_ran():
    """/usr/bin/chromium is a shell script that exec's the browser under the same pid: first seen, the
    process runs /bin/dash; its maps are chromium's. Judged by dash alone, chromium's libraries were
    flagged (a fresh-clone run, stop 64); by both executables, they are chromium's."""
    status = {"chromium": {"Depends": "libpulse0"}, "libpulse0": {}, "dash": {}}
    owners = {"/usr/bin/dash": "dash", "/usr/lib/chromium/chromium": "chromium",
              "/usr/lib/x86_64-linux-gnu/libpulse.so.0.24.2": "libpulse0"}
    label = "pid 872: /bin/sh /usr/bin/chromium --headless"
    processes = {label: {"/usr/lib/x86_64-linux-gnu/libpulse.so.0.24.2"}}
    kw = dict(base={"dash"}, project={"chromium": "test"}, owners=owners, status=status)
    assert [f.package for f in sp.hidden_packages(processes, {}, exes={label: {"/usr/bin/dash"}}, **kw)] == ["libpulse0"]
    assert sp.hidden_packages(processes, {}, exes={label: {"/usr/bin/dash", "/usr/lib/chromium/chromium"}}, **kw) == []


def test_merged_usr_paths_are_one_file():
    owners = {"/lib/x86_64-linux-gnu/libfoo.so.1": "libfoo1", "/usr/lib/x86_64-linux-gnu/libfoo.so.1": "libfoo1"}
    assert sp.owner("/usr/lib/x86_64-linux-gnu/libfoo.so.1", {"/lib/x86_64-linux-gnu/libfoo.so.1": "libfoo1"}) \
        == "libfoo1"
    assert sp.owner("/root/.venv/lib/libfoo.so.1", owners) is None  # a venv's file is no package's


def test_the_executables_the_project_calls_are_found_and_accounted_for():
    calls = sp.called_executables()
    assert calls["git"].startswith("difftest/") and calls["apt-get"].startswith("scripts/")
    assert calls["debootstrap"] == "scripts/clean-root.sh"
    base, project = sp.read_list(sp.base_list()), sp.read_uses(sp.PROJECT_LIST)
    assert sp.hidden_packages({}, calls, base=base, project=project) == []
    if Path("/usr/sbin/debootstrap").exists():  # installed by scripts/clean-root.sh where it ran
        found = sp.hidden_packages({}, calls, base=base, project={k: v for k, v in project.items() if k != "debootstrap"})
        assert [(f.package, f.where) for f in found] == [("debootstrap", "called by scripts/clean-root.sh")]


def test_shell_commands_skip_heredocs_functions_and_assignments():
    text = textwrap.dedent("""\
        helper() { date; }
        FOO=1 sox in.wav out.wav && helper | espeak-ng hi
        python - <<'EOF'
        import chromium
        EOF
        x=$(ffmpeg -i a); echo "then open it" 'or | this'
        """)
    assert list(sp._shell_commands(text)) == ["date", "sox", "espeak-ng", "python", "ffmpeg"]


def test_the_repository_copy_of_the_base_list_is_the_workplace_list():
    if sp.BASE_SHARED.exists():
        assert sp.BASE_COPY.read_text() == sp.BASE_SHARED.read_text(), \
            f"copy {sp.BASE_SHARED} over {sp.BASE_COPY}: the base list changed"
    assert len(sp.read_list(sp.BASE_COPY)) > 500 and "libc6" in sp.read_list(sp.BASE_COPY)


def test_a_session_that_loads_an_unlisted_package_fails_naming_it(tmp_path):
    """The whole hook in a pytest session of its own: its test starts a process that loads
    libsndfile, and the project list it is given lacks libsndfile1."""
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""\
        import subprocess, sys, time
        def test_loads_soundfile(request):
            p = subprocess.Popen([sys.executable, "-c", {SOUNDFILE!r}], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready"
            maps = request.config._system_packages.maps  # the session's own sampler, in its thread
            deadline = time.monotonic() + 120
            while not any("libsndfile" in f for m in list(maps.values()) for f in m) and time.monotonic() < deadline:
                time.sleep(0.1)
            p.stdin.close(); p.wait()
        """))
    listed = tmp_path / "system-packages.txt"
    listed.write_text("".join(line + "\n" for line in sp.PROJECT_LIST.read_text().splitlines()
                              if not line.startswith("libsndfile1")))
    env = {**os.environ, "DIFFTEST_SYSTEM_PACKAGES": str(listed), "PYTHONPATH": str(ROOT / "tests")}
    env.pop(sp.MARK, None)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "system_packages", "-p", "no:cacheprovider",
            "-p", "no:xdist", str(tmp_path / "test_inner.py")]
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 failed, 1 passed" in p.stdout, p.stdout
    assert "libsndfile1: /usr/lib/x86_64-linux-gnu/libsndfile.so" in p.stdout, p.stdout
    assert sp.NODEID in p.stdout
    # with the real list the same session passes
    env["DIFFTEST_SYSTEM_PACKAGES"] = str(sp.PROJECT_LIST)
    p = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr
