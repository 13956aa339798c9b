"""What of the papers' quantitative results the reproductions cover (``reproductions/coverage.toml``),
checked against the tables and written as a page (``stocfl-lab reproduce --coverage``).

Each [[result]] names a group of a paper's numbers (a table's column, a figure) and either the
reproduction table and rows that give them (headline rows, then diagnostic rows that vary the
setting) or why not. :func:`check` refuses a coverage file that names a row no table has, or
leaves out a row of a covered paper's tables that carries a paper number: so nothing a table
compares with the paper goes unaccounted. The page takes each row's figures from the table's
JSON record (ours, seeds, the difference), so it never drifts from the runs.
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Any

from stocfl.errors import UserError

from .records import read_table_record

STATUSES = ("reproduced", "reduced", "not attempted")


def load(root: Path) -> dict[str, Any]:
    path = root / "coverage.toml"
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
        papers, results = raw["paper"], raw["result"]
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError) as err:
        raise UserError(f"{path}: cannot be read as a coverage file ({type(err).__name__}: {err})") from None
    keys = {p["key"] for p in papers}
    for r in results:
        if r.get("paper") not in keys:
            raise UserError(
                f"{path}: result {r.get('where')!r} names paper {r.get('paper')!r}; declare it as [[paper]]"
            )
        if r.get("status") not in STATUSES:
            raise UserError(f"{path}: result {r.get('where')!r} has status {r.get('status')!r}; one of {STATUSES}")
        if r["status"] != "reproduced" and not r.get("why"):
            raise UserError(f"{path}: result {r['where']!r} is {r['status']} without a why")
    return raw


def row_diagnostic(table: dict[str, Any], row: dict[str, Any]) -> str:
    """What a table file's row changes from the table's protocol: its own ``diagnostic``, or the
    table's (a table of diagnostic runs), "" for a headline row."""
    return str(row.get("diagnostic", table.get("diagnostic", "")))


def _table_rows(root: Path, name: str) -> dict[str, dict[str, Any]]:
    """The rows of table ``name`` by name, in order, as declared (name, paper) with their
    record's figures where the table has a JSON record; read once while its files are unchanged
    (a page names a table's rows one by one)."""
    stamps = tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in (root / f"{name}.toml", root / f"{name}.json"))
    return _read_rows(root, name, stamps)


@functools.lru_cache(maxsize=64)
def _read_rows(root: Path, name: str, stamps: tuple[int, int]) -> dict[str, dict[str, Any]]:
    raw = tomllib.loads((root / f"{name}.toml").read_text(encoding="utf-8"))
    record = root / f"{name}.json"
    doc = read_table_record(record)
    recorded = {r["name"]: r for r in doc["rows"]} if doc is not None else {}
    return {
        r["name"]: {
            **recorded.get(r["name"], {}),
            "name": r["name"],
            "paper": r.get("paper"),
            "diagnostic": row_diagnostic(raw, r),
        }
        for r in raw["run"]
    }


def _named(result: dict[str, Any], root: Path | None = None) -> list[tuple[str, str]]:
    """(table, row) of every row a result names, headline and diagnostic (given ``root``: every
    diagnostic row of its table where it says ``all_diagnostics``, and every row of its
    ``diagnostic_tables``)."""
    out = [(result["table"], r) for r in result.get("rows", [])]
    for d in result.get("diagnostics", []):
        table, _, row = d.partition(": ")
        out.append((table, row))
    if root is None:
        return out
    if result.get("all_diagnostics"):
        out += [(result["table"], n) for n, r in _table_rows(root, result["table"]).items() if r["diagnostic"]]
    for table in result.get("diagnostic_tables", []):
        if not (root / f"{table}.toml").exists():
            raise UserError(f"coverage: result {result['where']!r} names table {table!r}, which reproductions/ lacks")
        out += [(table, row) for row in _table_rows(root, table)]
    return out


def check(root: Path) -> dict[str, Any]:
    """The coverage file, refused in one line where it names a row that no table has or leaves
    out a row of a covered paper's table that carries a paper number."""
    cov = load(root)
    named: set[tuple[str, str]] = set()
    for r in cov["result"]:
        headline = {(r.get("table"), n) for n in r.get("rows", [])}
        for table, row in _named(r, root):
            if not (root / f"{table}.toml").exists():
                raise UserError(f"coverage: result {r['where']!r} names table {table!r}, which reproductions/ lacks")
            rows = _table_rows(root, table)
            if row not in rows:
                raise UserError(f"coverage: result {r['where']!r} names row {row!r}, which table {table} lacks")
            # the headline column is the paper's protocol alone; a diagnostic is never mixed into it
            if (table, row) in headline and rows[row]["diagnostic"]:
                raise UserError(
                    f"coverage: result {r['where']!r} names {table}'s diagnostic row {row!r} among its headline "
                    f"rows; name it under diagnostics, or drop its diagnostic label if it runs the table's protocol"
                )
            named.add((table, row))
    for paper in cov["paper"]:
        if paper.get("pending"):
            continue
        for toml in sorted(root.glob(f"{paper['tables']}*.toml")):
            for row in _table_rows(root, toml.stem).values():
                if row["paper"] is None or (toml.stem, row["name"]) in named:
                    continue
                raise UserError(
                    f"coverage: row {row['name']!r} of {toml.stem} compares with the paper but no result in "
                    f"coverage.toml names it; add it to a result's rows or diagnostics"
                )
    return cov


def _paper(row: dict[str, Any]) -> str:
    """The paper's number for a row: the table's [mean, std] or its record's {mean, std}."""
    p = row.get("paper")
    if not p:
        return "-"
    return f"{p['mean'] if isinstance(p, dict) else p[0]:g}"


def _ours(row: dict[str, Any]) -> tuple[str, str]:
    ours = row.get("ours")
    if not ours or ours.get("n", 0) == 0:
        return row.get("status", "not run"), "-"
    n, half = ours["n"], ours.get("ci95")
    interval = f" ± {half:.2f}" if n > 1 and half is not None else ""
    status = row.get("status", "done")
    if status != "done":  # the seeds a row declares and has not run yet are pending: say so
        note = status
    elif n == 1:
        note = "1 seed"
    else:  # a record written before intervals were kept has none
        note = f"{n} seeds" if half is not None else f"{n} seeds, no interval recorded"
    diff = row.get("difference")
    return f"{ours['mean']:.2f}{interval} ({note})", "-" if diff is None else f"{diff:+.2f}"


def page(root: Path) -> str:
    cov = check(root)
    lines = [
        "# Coverage of the papers' results",
        "",
        "<!-- written by `stocfl-lab reproduce --coverage` from reproductions/coverage.toml and the tables' "
        "JSON records: do not edit -->",
        "",
        "Every quantitative result of the papers, by group (a table's column, a figure): reproduced (the "
        "paper's setting), reduced (a changed setting, and why) or not attempted (why), with our figure beside "
        "the paper's for every row and what explains the difference where a run does. A test checks that "
        "every row of a covered paper's tables that compares with the paper is named here. Headline rows run "
        "the table's one protocol (the training the paper states); a diagnostic row varies one setting to test "
        "an explanation and says which. Ours is the mean ± the half-width of its 95% confidence interval over "
        "seeds (Student's t).",
        "",
    ]
    for paper in cov["paper"]:
        lines += [f"## {paper['title']}", ""]
        if paper.get("pending"):
            lines += [f"Not accounted for yet: {paper['pending']}.", ""]
            continue
        results = [r for r in cov["result"] if r["paper"] == paper["key"]]
        counts = {s: 0 for s in STATUSES}
        for r in results:
            counts[r["status"]] += len(r.get("rows", [])) if "table" in r else int(r.get("numbers", 0))
        lines += [
            "Numbers of the paper: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".",
            "",
        ]
        for r in results:
            lines += [f"### {r['where']}", "", f"**{r['status']}**" + (f": {r['why']}" if r.get("why") else "") + "."]
            if r.get("explained"):
                lines += ["", f"The difference: {r['explained']}."]
            lines.append("")
            if "table" not in r:
                continue
            rows = _table_rows(root, r["table"])
            lines += [
                f"Table `{r['table']}` (reproductions/{r['table']}.md):",
                "",
                "| row | paper | ours | difference |",
                "|---|---|---|---|",
            ]
            for name in r.get("rows", []):
                row = rows[name]
                ours, diff = _ours(row)
                lines.append(f"| {name} | {_paper(row)} | {ours} | {diff} |")
            diag = [(t, n) for t, n in _named(r, root) if n not in r.get("rows", []) or t != r["table"]]
            if diag:
                lines += ["", "Diagnostic rows (another setting than the paper's, to test an explanation):", ""]
                lines += ["| table: row | what it varies | paper | ours | difference |", "|---|---|---|---|---|"]
                for t, n in diag:
                    row = _table_rows(root, t)[n]
                    ours, diff = _ours(row)
                    lines.append(f"| {t}: {n} | {row['diagnostic'] or '-'} | {_paper(row)} | {ours} | {diff} |")
            lines.append("")
    return "\n".join(lines) + "\n"
