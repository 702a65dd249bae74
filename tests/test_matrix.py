"""`difftest run --matrix`: the cells of a configuration matrix, their names and the exit code, and
the bad input refused before any model work."""

import pytest

from difftest.cli import main
from difftest.errors import BadInput
from difftest.commands.run_matrix import axes, cell_name, cells, exit_code


def test_cells_are_the_product_first_axis_slowest():
    grid = cells(axes(["async_chunk=false,true", "talker.enable_prefix_caching=false,true"]))
    assert grid == [["async_chunk=false", "talker.enable_prefix_caching=false"],
                    ["async_chunk=false", "talker.enable_prefix_caching=true"],
                    ["async_chunk=true", "talker.enable_prefix_caching=false"],
                    ["async_chunk=true", "talker.enable_prefix_caching=true"]]
    assert cell_name(grid[1]) == "async_chunk-false__talker.enable_prefix_caching-true"
    assert len({cell_name(c) for c in grid}) == 4  # one folder each


@pytest.mark.parametrize("texts, words", [
    (["async_chunk"], "expected KEY=VALUE1,VALUE2"),
    (["async_chunk=true,"], "expected KEY=VALUE1,VALUE2"),
    (["async_chunk=true", "async_chunk=false"], "async_chunk is already an axis"),
    (["thinker.x=1,2"], "stage 'thinker'"),
])
def test_a_malformed_axis_is_named(texts, words):
    with pytest.raises(BadInput, match=words):
        axes(texts)


def test_too_many_cells_are_refused():
    with pytest.raises(BadInput, match="32 cells, at most 16"):
        cells(axes([f"talker.k{i}=a,b" for i in range(5)]))


def test_a_failing_cell_decides_then_an_unrunnable_one():
    assert exit_code([{"exit_code": 0}, {"exit_code": 0}]) == 0
    assert exit_code([{"exit_code": 0}, {"exit_code": 3}]) == 3
    assert exit_code([{"exit_code": 3}, {"exit_code": 1}, {"exit_code": 0}]) == 1


def test_a_matrix_over_an_engine_difftest_does_not_start_exits_2(tmp_path, capsys):
    code = main(["run", "cases/suites/smoke.yaml", "--candidate", "cpu-engine", "--out", str(tmp_path / "o"),
                 "--store", str(tmp_path / "s"), "--no-mlflow", "--matrix", "async_chunk=false,true"])
    err = capsys.readouterr().err
    assert code == 2 and "--matrix varies the settings of a vLLM-Omni that difftest starts" in err
    assert not (tmp_path / "o" / "matrix.json").exists()
