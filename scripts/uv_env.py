"""Print `export UV_...=...` lines that make uv install from where pip installs here.

    eval "$(python3 scripts/uv_env.py)"          (scripts/lib.sh: uv_setup)

uv reads neither pip.conf nor PIP_* variables. This machine's pip takes wheels from local folders
and indexes (find-links, extra indexes: a CPU torch among them), a constraint file and a CA bundle;
uv gets the same, and pip's rule for several indexes (the best version from any of them, not the
first index that has the package), and byte-compiling at install as pip does. Only what pip's own
configuration says is translated; pip's environment variables win over its files, as pip has it.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

# pip's key -> uv's variable (lists: space-separated for both)
KEYS = {"index-url": "UV_DEFAULT_INDEX", "extra-index-url": "UV_EXTRA_INDEX_URL", "find-links": "UV_FIND_LINKS",
        "constraint": "UV_CONSTRAINT", "cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT",
        "timeout": "UV_HTTP_TIMEOUT"}


def pip_settings() -> dict[str, str]:
    """pip's configuration as `pip config list` gives it: files first, then PIP_* (:env:) over them."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=False).stdout
    files, env = {}, {}
    for line in out.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if not key or not value:
            continue
        value = value.strip().strip("'\"")
        if section == ":env:":
            env[key] = value
        elif section in ("global", "install"):
            files[key] = value
    return {**files, **env}


def main() -> int:
    settings = pip_settings()
    # Byte-compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (CI here) no module
    # would ever be compiled to disk, and every process would compile vLLM, torch and MLflow again.
    exports = {"UV_INDEX_STRATEGY": "unsafe-best-match", "UV_COMPILE_BYTECODE": "1"}
    for key, var in KEYS.items():
        if settings.get(key):
            exports[var] = settings[key]
    if "UV_FIND_LINKS" in exports:  # uv takes this list comma-separated
        exports["UV_FIND_LINKS"] = ",".join(exports["UV_FIND_LINKS"].split())
    for var, value in exports.items():
        print(f"export {var}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
