"""`python -m dashboards --out SITE ...`: `difftest dashboard` on its own."""

import sys

from difftest.cli import main

sys.exit(main(["dashboard", *sys.argv[1:]]))
