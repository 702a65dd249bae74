"""`python -m difftest.bisect bisect|probe ...` (for `git bisect run`): `difftest bisect|probe ...`."""

import sys

from ..cli import main

sys.exit(main(sys.argv[1:]))
