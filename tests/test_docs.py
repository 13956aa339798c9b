"""The README and the docs as a user runs them: every command of their shell blocks, in order, in
a scratch directory (as a clone's root: configs/ and reproductions/ beside it), and every Python
block, each as a script. A block right after ``<!-- not run by the tests: REASON -->`` is left
out, and says why where a reader sees it. The data directory the suite finds stands in for
``../shared/data``; without one, the commands that need it are skipped, not passed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import find_data_dir
from tests.helpers import REPO

pytestmark = pytest.mark.long

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SKIP = "<!-- not run by the tests:"
BIN = Path(sys.executable).parent


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of ``page`` that the tests run."""
    text = page.read_text()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        before = text[: m.start()].rstrip().splitlines()[-1:] or [""]
        if not before[0].startswith(SKIP):
            out.append((m.group(1), m.group(2)))
    return out


def commands(page: Path) -> list[str]:
    """The stocfl and stocfl-lab command lines of a page's shell blocks (continuations joined,
    comments dropped)."""
    found = []
    for lang, body in blocks(page):
        if lang not in ("", "sh", "bash", "console"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.split()[:1] not in (["stocfl"], ["stocfl-lab"]):
                continue
            words = shlex.split(line, comments=True)
            if words and words[0] in ("stocfl", "stocfl-lab"):
                found.append(words)
    return found


def scratch(tmp_path: Path) -> Path:
    for name in ("configs", "reproductions"):
        (tmp_path / name).symlink_to(REPO / name)
    return tmp_path


def run_commands(page: Path, cwd: Path) -> None:
    data = find_data_dir()
    for words in commands(page):
        if "../shared/data" in words:
            if data is None:
                pytest.skip(f"{page.name}: {' '.join(words)} needs the real data: set STOCFL_DATA_DIR")
            words = [str(data) if w == "../shared/data" else w for w in words]
        env = {**os.environ, "NO_COLOR": "1"}
        p = subprocess.run([str(BIN / words[0]), *words[1:]], cwd=cwd, capture_output=True, text=True, env=env)
        assert p.returncode == 0, f"{page.name}: {shlex.join(words)} exited {p.returncode}: {p.stderr[-2000:]}"


def run_python(page: Path, cwd: Path) -> None:
    for lang, body in blocks(page):
        if lang != "python":
            continue
        p = subprocess.run([sys.executable, "-c", body], cwd=cwd, capture_output=True, text=True)
        assert p.returncode == 0, f"{page.name}: a Python block failed:\n{body}\n{p.stderr[-3000:]}"


def test_every_page_with_commands_is_covered():
    """A page whose shell blocks hold stocfl commands is run by a test below (add it there)."""
    pages = {p.relative_to(REPO).as_posix() for p in PAGES if commands(p)}
    assert pages <= {
        "README.md",
        "docs/running.md",
        "docs/quickstart.md",
        "docs/flower.md",
        "docs/benchmark-design.md",
    }, pages


def test_the_readme_runs_as_printed(tmp_path):
    cwd = scratch(tmp_path)
    run_commands(REPO / "README.md", cwd)
    run_python(REPO / "README.md", cwd)
    # the results page's Python block loads the models that the README's commands exported
    run_python(REPO / "docs" / "results.md", cwd)


def test_the_running_page_runs_as_printed(tmp_path):
    run_commands(REPO / "docs" / "running.md", scratch(tmp_path))


def test_the_quickstart_and_the_python_api_page_run_as_printed(tmp_path):
    cwd = scratch(tmp_path)
    page = REPO / "docs" / "quickstart.md"
    text = page.read_text()
    data = find_data_dir()
    assert "--data-dir DIR" in text  # the quickstart's placeholder for the user's data directory
    for words in commands(page):
        words = [str(data) if w == "DIR" and data is not None else w for w in words]
        if "DIR" in words:
            pytest.skip("the quickstart's MNIST run needs the real data: set STOCFL_DATA_DIR")
        p = subprocess.run([str(BIN / words[0]), *words[1:]], cwd=cwd, capture_output=True, text=True)
        assert p.returncode == 0, f"quickstart: {shlex.join(words)}: {p.stderr[-2000:]}"
    run_python(REPO / "docs" / "python-api.md", cwd)


def test_the_benchmark_page_runs_as_printed(tmp_path):
    """The quick grid and the leaderboard, from a copy of the grid and its record: the page it
    writes is the committed one."""
    import shutil

    (tmp_path / "benchmark").mkdir()
    (tmp_path / "docs").mkdir()
    for name in ("grid.toml", "BENCHMARK.json"):
        shutil.copy(REPO / "benchmark" / name, tmp_path / "benchmark" / name)
    run_commands(REPO / "docs" / "benchmark-design.md", tmp_path)
    assert (tmp_path / "quick.md").read_text().startswith("# The clustered-FL benchmark (quick grid)")
    assert (tmp_path / "docs" / "benchmark.md").read_text() == (REPO / "docs" / "benchmark.md").read_text()


def test_the_flower_page_certificates_command_runs(tmp_path):
    """The deployment manual's processes are run by tests/flower/test_flower_deployment.py; its
    certificate command is run here as printed."""
    words = next(w for w in commands(REPO / "docs" / "flower.md") if w[:2] == ["stocfl", "certs"])
    home = tmp_path / "flwr_home"
    words = [w.replace("$FLWR_HOME", str(home)) for w in words]
    p = subprocess.run([str(BIN / words[0]), *words[1:]], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 0 and (home / "certs" / "ca.crt").is_file(), p.stderr
