"""`python -m dashboards --out SITE ...`: `difftest dashboard` on its own."""

import sys

from difftest.tracking import run_standalone

from .cli import add_dashboard_parser

sys.exit(run_standalone(add_dashboard_parser, "dashboard"))
