"""`difftest bisect` / `difftest probe`: which commit of the candidate broke parity.

Split as mozregression splits it: what to test (probe.py: run a suite on one commit's
candidate, decide good / bad / skip), how to start a build (builds.py: git worktree and
editable install per commit, cached; launchers as context managers) and how to search
(search.py: pure bisection over good/bad/skip answers). session.py keeps the books
(bisect.json, MLflow via record.py); cli.py holds the two subcommands. docs/bisect.md.
"""
