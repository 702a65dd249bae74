"""`python -m difftest ...`: the difftest command."""

import sys

from .cli import main

sys.exit(main())
