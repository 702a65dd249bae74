"""`python -m difftest.dashboard --out SITE ...`: the subcommand on its own, until difftest/cli.py wires it in."""

import sys

from ..tracking import run_standalone
from .cli import add_dashboard_parser

sys.exit(run_standalone(add_dashboard_parser, "dashboard"))
