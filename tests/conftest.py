import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/toy.py, the vocoder test double


@pytest.fixture
def policy():
    from difftest.policy import load_policy
    return load_policy()
