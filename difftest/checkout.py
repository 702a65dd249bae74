"""Where this checkout is: the root that runners/, cases/, the environments (.venv-*) and the
default cache are found under. One place: a module that computes it from its own depth breaks
when it moves (stop 67's selfcheck default suite)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
