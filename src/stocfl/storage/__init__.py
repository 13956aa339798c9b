"""What stocfl keeps on disk: atomic files and locks, checkpoints, algorithm state, per-client
stores, the JSONL/TOML/CSV formats, TensorBoard scalars."""

from stocfl.storage.files import exclusive, holder, save_figure, write_atomic
from stocfl.storage.formats import append_jsonl, json_line, read_jsonl, to_toml, write_csv, write_json, write_jsonl

__all__ = [
    "append_jsonl",
    "exclusive",
    "holder",
    "json_line",
    "read_jsonl",
    "save_figure",
    "to_toml",
    "write_atomic",
    "write_csv",
    "write_json",
    "write_jsonl",
]
