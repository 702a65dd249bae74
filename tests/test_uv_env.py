"""scripts/uv_env.py: uv gets pip's package sources (scripts/lib.sh: uv_setup), so the installs take
the same wheels whichever tool runs them (this machine's CPU torch lies in a find-links folder)."""

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def exports(tmp_path: Path, conf: str, **env) -> dict:
    (tmp_path / "pip.conf").write_text(conf)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_"))}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "uv_env.py")], capture_output=True, text=True,
                         check=True, env={**base, "PIP_CONFIG_FILE": str(tmp_path / "pip.conf"), **env}).stdout
    pairs = [shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in out.splitlines()]
    return dict(pairs)


def test_pips_sources_become_uvs(tmp_path):
    got = exports(tmp_path, "[global]\nfind-links = /wheels/a /wheels/b\nextra-index-url = file:///idx/one file:///idx/two\n"
                            "constraint = /c/constraints.txt\n", PIP_DEFAULT_TIMEOUT="7")
    assert got["UV_FIND_LINKS"] == "/wheels/a,/wheels/b"  # uv's list is comma-separated
    assert got["UV_EXTRA_INDEX_URL"] == "file:///idx/one file:///idx/two"
    assert got["UV_CONSTRAINT"] == "/c/constraints.txt" and got["UV_HTTP_TIMEOUT"] == "7"
    assert got["UV_INDEX_STRATEGY"] == "unsafe-best-match"  # pip's rule: the best version of any index
    # compiled at install as pip does: with PYTHONDONTWRITEBYTECODE set, nothing would be compiled later
    assert got["UV_COMPILE_BYTECODE"] == "1"


def test_pips_environment_wins_over_its_files(tmp_path):
    got = exports(tmp_path, "[global]\nfind-links = /from/file\nindex-url = https://mirror.example/simple\n",
                  PIP_FIND_LINKS="/from/env")
    assert got["UV_FIND_LINKS"] == "/from/env" and got["UV_DEFAULT_INDEX"] == "https://mirror.example/simple"
