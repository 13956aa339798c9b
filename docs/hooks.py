"""MkDocs hooks: the parts of the docs that the code already states are generated from it at build
time, so they cannot drift: the configuration reference (every key, its default and meaning,
from the config schema), each algorithm's parameter table (from its ``Params``), the engines."""

from __future__ import annotations

import re


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def config_reference() -> str:
    from stocfl.experiment.configure import reference

    out, section = [], None
    for sec, key, default, meaning in reference():
        if sec != section:
            section = sec
            out += ["", f"## [{sec}]", "", "| key | default | meaning |", "|---|---|---|"]
        out.append(f"| `{key}` | `{_cell(default)}` | {_cell(meaning)} |")
    return "\n".join(out).strip() + "\n"


def algorithm_params(name: str) -> str:
    from stocfl.algorithms import algorithm_class
    from stocfl.experiment.configure import _choices, _toml

    cls = algorithm_class(name)
    rows = ["| key in `[algorithm]` | default | meaning |", "|---|---|---|"]
    for key, f in cls.Params.model_fields.items():
        rows.append(
            f"| `{f.alias or key}` | `{_cell(_toml(f.default))}` | {_cell(f.description)}{_cell(_choices(f))} |"
        )
    if len(rows) == 2:
        rows.append("| (none) | | |")
    return "\n".join(rows) + "\n"


def engines() -> str:
    from stocfl.executors import ENGINES

    rows = ["| `run.engine` | what it is |", "|---|---|"]
    rows += [f"| `{n}` | {_cell(e.description)} |" for n, e in ENGINES.items()]
    return "\n".join(rows) + "\n"


def repository_file(name: str) -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / name).read_text()


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = re.sub(r"<!-- stocfl:file ([\w.]+) -->", lambda m: repository_file(m.group(1)), markdown)
    markdown = markdown.replace("<!-- stocfl:config -->", config_reference())
    markdown = markdown.replace("<!-- stocfl:engines -->", engines())
    return re.sub(r"<!-- stocfl:params (\w+) -->", lambda m: algorithm_params(m.group(1)), markdown)


def on_files(files, config):
    """The reproductions' tables (``reproductions/*.md`` and their figures) become pages of the
    site under ``reproductions/``, as committed: the docs link them, and they are never copied."""
    from pathlib import Path

    from mkdocs.structure.files import File

    root = Path(__file__).resolve().parents[1] / "reproductions"
    for path in sorted([*root.glob("*.md"), *root.glob("*.png")]):
        files.append(File.generated(config, f"reproductions/{path.name}", abs_src_path=str(path)))
    return files
