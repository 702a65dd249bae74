"""The verdict table (difftest/verdicts/catalogue.py) is the one list: what classify ranks, what
report.json may say, what the default policy fails on, what the dashboard colours and counts as
clean, and the tables of the README and docs/verdicts.md, all agree with it."""

import ast
import re
from pathlib import Path

import yaml

from dashboards import assets, model, pages
from difftest.records import report
from difftest.verdicts import catalogue, checks, policy
from difftest.verdicts.catalogue import BY_NAME, FAILS, RANK, SEGMENT_VERDICTS, TABLE, VERDICTS

REPO = Path(__file__).resolve().parents[1]


def test_every_module_reads_the_one_table():
    assert checks.REGISTRY.verdicts is TABLE and policy.VERDICTS is VERDICTS and report.VERDICTS is VERDICTS
    assert policy.DEFECTS == FAILS and model.DEFAULT_FAIL_ON == FAILS and model.CLEAN == ("identical", "numeric_drift")
    assert assets.VERDICT_COLOURS == {v: BY_NAME[v].colour for v in VERDICTS}
    assert pages.SERIOUSNESS == tuple(v for v in RANK if v not in ("vocoder_length", "numeric_drift", "identical"))


def test_the_table_is_whole():
    names = [v.name for v in TABLE]
    assert len(names) == len(set(names))
    ranks = sorted(v.rank for v in TABLE if v.rank is not None)
    assert ranks == list(range(len(ranks)))  # a strict order: no two findings tie
    assert RANK[0] == "error" and RANK[-1] == "identical"
    assert set(SEGMENT_VERDICTS) | {"vocoder_length"} == set(RANK) and "sampling_defect" in VERDICTS
    assert all(BY_NAME[v].reported_as in VERDICTS for v in BY_NAME if BY_NAME[v].reported_as)
    assert not any(BY_NAME[v].fails and BY_NAME[v].clean for v in VERDICTS)
    assert catalogue.reported("vocoder_length") == "length_mismatch" and catalogue.reported("error") == "error"


def test_every_finding_a_check_gives_is_in_the_table():
    """The kinds written as `Finding("...")` anywhere in difftest, read from the source."""
    kinds = set()
    for path in (REPO / "difftest").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Finding" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                kinds.add(node.args[0].value)
    assert len(kinds) >= 14 and kinds <= set(RANK), kinds - set(RANK)


def test_the_default_policy_fails_on_what_the_table_says():
    raw = yaml.safe_load((REPO / "difftest" / "verdicts" / "default_policy.yaml").read_text())
    assert set(raw["fail_on"]) == set(FAILS) and len(raw["fail_on"]) == len(FAILS)
    assert policy.load_policy().fail_on == frozenset(FAILS) and policy.load_policy().warnings() == []


def test_the_readme_table_is_the_tables():
    assert catalogue.readme_table() in (REPO / "README.md").read_text()


def test_docs_verdicts_lists_them_most_serious_first_with_whether_they_fail():
    text = (REPO / "docs" / "verdicts.md").read_text()
    table = text[text.index("| verdict | meaning | stage | fails by default |"):]
    table = table[:table.index("\n\n")]
    rows = [re.match(r"\| `(\w+)` \|.*\| (yes|no) \|$", line) for line in table.splitlines()[2:]]
    assert all(rows), table
    assert [m[1] for m in rows] == [v for v in RANK if v != "vocoder_length"]
    assert {m[1]: m[2] == "yes" for m in rows} == {v: BY_NAME[v].fails for v in SEGMENT_VERDICTS}
