"""``stocfl-lab bench --tables``: a real table's declared setting timed against its bound, the
JSON kept table by table, and bad arguments refused in one line."""

from __future__ import annotations

import json

import pytest

from stocfl_lab.cli import main


def test_a_table_is_timed_against_its_arithmetic_and_kept(data_dir, tmp_path, capsys):
    out = tmp_path / "tables.json"
    args = ["bench", "--tables", "--table", "stocfl-fig3-clustering", "--rounds", "1", "--data-dir", str(data_dir)]
    assert main([*args, "--out", str(out)]) == 0
    got = json.loads(out.read_text())["tables"]["stocfl-fig3-clustering"]
    (r,) = got["per_round"]
    assert r["gflop"] > 0 and r["seconds"] > 0 and got["matmul_peak_gflops"] > 0
    # seconds / (FLOPs / peak), from the figures it prints
    assert got["over_bound"] == pytest.approx(
        r["seconds"] / (r["gflop"] * 1e9 / (got["matmul_peak_gflops"] * 1e9)), rel=0.02
    )
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 0  # kept, not timed again
    assert "stocfl-fig3-clustering: kept" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "--tables", "--table", "no-such-table"], "no table 'no-such-table'"),
        (["bench", "--tables", "--rounds", "0"], "--rounds must be >= 1"),
        (["bench", "--rounds", "2"], "add --tables"),
    ],
)
def test_bad_arguments_are_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is unreadable"),
        ("[1, 2]", "is not a table bench's results"),
        ('{"tables": {"t": {"rounds": "2", "date": "2026-12-06"}}}', "table 't' has no whole entry"),
        ('{"tables": {"t": 5}}', "table 't' has no whole entry"),
    ],
)
def test_a_damaged_results_file_is_one_line_before_anything_is_timed(tmp_path, capsys, text, says):
    out = tmp_path / "tables.json"
    out.write_text(text)
    assert main(["bench", "--tables", "--table", "stocfl-fig3-clustering", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and str(out) in err and "\n" not in err
    assert out.read_text() == text
