"""The ``stocfl-lab`` command's entry point: ``stocfl_lab.cli.main`` with its imports guarded
against Ctrl-C and SIGTERM (one line, not a traceback; see ``_stocfl_launch``)."""

from _stocfl_launch import launch


def main() -> int:
    return launch("stocfl-lab", "stocfl_lab.cli")
