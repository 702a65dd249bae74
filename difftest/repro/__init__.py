"""`difftest repro`: from a finding to the smallest reproduction, a standalone script and an issue text.

shrink (the search, pure) -> probe (a case served as a short `difftest run`, cached) -> bundle
(repro.py with the standard library only, ISSUE.md, the minimal suite) -> cli.
"""
