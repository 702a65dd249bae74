"""`python -m difftest.handoff ...`: `difftest handoff ...`."""

import sys

from ..cli import main

sys.exit(main(["handoff", *sys.argv[1:]]))
