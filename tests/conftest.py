import os
import sys
from pathlib import Path

import pytest

# Every Ray cluster the tests start stays on the loopback (its GCS, raylets and workers register
# and listen on 127.0.0.1; Ray on Linux otherwise picks the external interface). Set before any
# test module imports Ray, and inherited by every process the tests start (docs/scale-out.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/toy.py, the vocoder test double

# Every Debian package the session's processes load must be on a new machine or installed by the
# project's scripts: one more test result at the end (tests/system_packages.py).
from system_packages import pytest_configure, pytest_sessionfinish  # noqa: E402,F401


@pytest.fixture
def policy():
    from difftest.verdicts.policy import load_policy
    return load_policy()


def _require_mlflow():
    try:
        import mlflow  # noqa: F401
    except ImportError:
        pytest.fail("mlflow is not installed in this environment: run scripts/test.sh "
                    "(it installs the 'test' extra, which includes mlflow)", pytrace=False)


# MLflow fixtures (tests/mlflow_support.py). mlflow is imported only when a test asks for one.
@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, _empty_mlflow_store):
    """A real `mlflow server` on loopback for the whole session; yields its URI."""
    from mlflow_support import serve

    with serve(tmp_path_factory.mktemp("mlflow-server"), store=_empty_mlflow_store) as uri:
        yield uri


@pytest.fixture(scope="session")
def _empty_mlflow_store(tmp_path_factory):
    _require_mlflow()
    from mlflow_support import make_empty_store

    return make_empty_store(tmp_path_factory.mktemp("mlflow-template"))


@pytest.fixture
def mlflow_cwd(tmp_path, monkeypatch, _empty_mlflow_store):
    """A working folder holding an empty sqlite store: where difftest's default URI points."""
    from mlflow_support import copy_store

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    copy_store(_empty_mlflow_store, cwd)
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return cwd


def pytest_collection_modifyitems(config, items):
    """Slowest files first (tests/durations.txt, measured), the rest after in their own order: with
    `--dist loadfile --no-loadscope-reorder` (scripts/test.sh) xdist hands files out in this order,
    so no long file starts last while the other worker idles. Only the order changes."""
    table = Path(__file__).with_name("durations.txt")
    seconds = {}
    for line in table.read_text().splitlines() if table.exists() else []:
        if line and not line.startswith("#"):
            s, name = line.split(maxsplit=1)
            seconds[name] = float(s)
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))  # stable: a file's tests keep their order
    if _install_pending():
        # the vLLM-Omni environment is still installing (scripts/test.sh starts the tests meanwhile): as
        # many of the slowest files that do not need it as there are workers go first, so none starts
        # by waiting for it
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "2"))
        free = [f for f in dict.fromkeys(item.path for item in items) if not _needs_vllm_omni(f)][:workers]
        items.sort(key=lambda item: item.path not in free)


# Files that may use the vLLM-Omni environment (a broad net: a file caught wrongly only waits).
_VLLM_OMNI_WORDS = ("vllm", "omni", "bisect", "bugs", "handoff")


def _needs_vllm_omni(path: Path) -> bool:
    text = path.read_text(encoding="utf-8", errors="replace").lower()
    return any(w in text for w in _VLLM_OMNI_WORDS)


def _install_pending() -> bool:
    from difftest.engines.vllm_omni import INSTALL_RC_VAR

    rc = os.environ.get(INSTALL_RC_VAR)
    return bool(rc) and not Path(rc).exists()


@pytest.fixture(scope="module", autouse=True)
def _vllm_omni_installed(request):
    """A file that may use the vLLM-Omni environment waits until scripts/test.sh has installed it
    (module scope and autouse: before the file's own module fixtures start anything)."""
    if _install_pending() and _needs_vllm_omni(request.path):
        from difftest.engines.vllm_omni import wait_for_install

        wait_for_install()


# A zygote for the qwen-tts environment (runners/zygote.py, difftest/process/zygote.py): every
# runner and CPU engine the tests start, in this process or in a `difftest` they run, is forked from
# it instead of importing torch, transformers and qwen-tts again (6-15 s each on two cores, about a
# hundred times a session). Started in the background: a runner started meanwhile waits for it.
# Tests of process lifecycles that follow parent links use `plain_processes`.
@pytest.fixture(scope="session", autouse=True)
def _qwen_tts_zygote(tmp_path_factory):
    from zygote_support import zygote_of_the_reference

    with zygote_of_the_reference(tmp_path_factory.getbasetemp() / "zygote.log") as sock:
        yield sock


@pytest.fixture
def plain_processes(monkeypatch):
    """Runners and engines started as fresh interpreters, children of whoever starts them."""
    from difftest.process.zygote import ENV

    monkeypatch.delenv(ENV, raising=False)
