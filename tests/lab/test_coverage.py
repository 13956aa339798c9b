"""The coverage of the papers' results (reproductions/coverage.toml): the committed page is what the
file and the tables' records give; a row that compares with a covered paper and is named nowhere,
and a name that is no table's row, are refused in one line."""

from __future__ import annotations

import shutil

import pytest

from stocfl.errors import UserError
from stocfl_lab.cli import main as lab
from stocfl_lab.coverage import check, page
from tests.helpers import REPO

ROOT = REPO / "reproductions"


def test_the_committed_page_is_what_the_coverage_file_and_records_give():
    assert (REPO / "docs" / "coverage.md").read_text() == page(ROOT), (
        "run: stocfl-lab reproduce --coverage --out docs/coverage.md"
    )


def test_every_number_of_the_stocfl_and_flhc_papers_is_accounted_for():
    """StoCFL: Table 1's 56 numbers, the CFL-setting table's 8, Tables 2-4 (7, 28, 8), Figs. 3,
    4, 5, 8. FL+HC: Tables I-VI."""
    cov = check(ROOT)
    results = [r for r in cov["result"] if r["paper"] == "stocfl"]
    total = sum(len(r["rows"]) if "table" in r else r.get("numbers", 0) for r in results)
    assert total == 56 + 8 + 7 + 28 + 8 + 4 + 1 + 2 + 6
    flhc = [r for r in cov["result"] if r["paper"] == "flhc"]
    # Tables I and II 16 settings x 4, III 15 x 4, IV-VI 10, 9 and 10 settings x 4
    assert sum(len(r["rows"]) if "table" in r else r["numbers"] for r in flhc) == 64 + 64 + 60 + 40 + 36 + 40


def _copy(tmp_path):
    d = tmp_path / "reproductions"
    shutil.copytree(ROOT, d, ignore=shutil.ignore_patterns("runs", "*.png"))
    return d


def test_a_row_named_nowhere_is_refused(tmp_path):
    d = _copy(tmp_path)
    text = (d / "coverage.toml").read_text()
    head = (
        '"Ditto", "IFCA M=2", "IFCA M=4", "IFCA M=6"]\nall_diagnostics = true\n'
        'diagnostics = [\n    "stocfl-table1-4800x50-gaps'
    )
    assert head in text
    (d / "coverage.toml").write_text(text.replace(head, head.replace('"Ditto", ', "")))
    with pytest.raises(UserError, match=r"row 'Ditto' of stocfl-table1-4800x50 compares with the paper but no result"):
        check(d)


def test_a_name_that_is_no_row_is_one_line(tmp_path, capsys):
    d = _copy(tmp_path)
    text = (d / "coverage.toml").read_text()
    (d / "coverage.toml").write_text(
        text.replace('rows = ["FedAvg", "IFCA", "CFL", "StoCFL"]', 'rows = ["FedAvg", "IFCA", "CFL", "StoCFL", "Nope"]')
    )
    assert lab(["reproduce", "--coverage", "--tables", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert "names row 'Nope', which table stocfl-cfl-setting lacks" in err and "\n" not in err
    (d / "coverage.toml").write_text(text.replace('status = "not attempted"', 'status = "maybe"', 1))
    assert lab(["reproduce", "--coverage", "--tables", str(d)]) == 2
    assert "has status 'maybe'" in capsys.readouterr().err


def test_a_diagnostic_row_named_among_the_headline_rows_is_refused_and_an_unlabelled_one_must_be_named(tmp_path):
    d = _copy(tmp_path)
    text = (d / "coverage.toml").read_text()
    (d / "coverage.toml").write_text(
        text.replace(
            'rows = ["FedAvg", "IFCA", "CFL", "StoCFL"]',
            'rows = ["FedAvg", "IFCA", "CFL", "StoCFL", "StoCFL, w in a chain (the authors\' code)"]',
            1,
        )
    )
    with pytest.raises(
        UserError,
        match=r"names stocfl-cfl-setting's diagnostic row \"StoCFL, w in a chain \(the "
        r"authors' code\)\" among its headline rows",
    ):
        check(d)
    # a row that lost its diagnostic label runs the table's protocol: it must be named as a headline row
    (d / "coverage.toml").write_text(text)
    table = (d / "stocfl-fig3-clustering.toml").read_text()
    label = 'name = "Rotated, paper\'s Psi"\ndiagnostic = '
    assert label in table
    (d / "stocfl-fig3-clustering.toml").write_text(table.replace(label, 'name = "Rotated, paper\'s Psi"\nnote = '))
    with pytest.raises(
        UserError,
        match=r"row \"Rotated, paper's Psi\" of stocfl-fig3-clustering compares with the "
        r"paper but no result",
    ):
        check(d)
