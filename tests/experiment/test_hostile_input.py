"""Hostile configs and API arguments (issue 70, findings 17-24, 26, 27): each is one clear line
(a UserError from Python, exit code 2 and one line from the command line) before a round runs,
never a traceback, never a run that ends with accuracy null."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stocfl
from stocfl.cli import main
from stocfl.errors import UserError
from tests.experiment.test_api import rotated_clients

SHORT = {"run": {"rounds": 2, "sample_rate": 0.5}}


def federation():
    train, test, groups = rotated_clients(n_per_group=2, per_client=20, test=10)
    return stocfl.Federation.from_arrays(train=train, test=test, groups=groups)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and msg, msg
    return msg


# 17: nesting before parsing


def test_a_deeply_nested_config_file_or_set_is_one_line(tmp_path, capsys):
    deep = "[" * 3000 + "]" * 3000
    cfg = tmp_path / "deep.toml"
    cfg.write_text(f"[run]\nrounds = {deep}\n")
    for argv in (["run", str(cfg)], ["run", "--set", f"run.rounds={deep}", "--out", str(tmp_path / "o")]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("stocfl: error:") and "\n" not in err and "nested deeper" in err, err[:300]


# 18, 19, 24: the model


class Raises(nn.Module):
    def __init__(self, error):
        super().__init__()
        self.lin, self.error = nn.Linear(64, 10), error

    def forward(self, x):
        raise self.error


class Returns(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.lin, self.how = nn.Linear(64, 10), how

    def forward(self, x):
        out = self.lin(x.flatten(1))
        return {"logits": out} if self.how == "dict" else (out, out)


class NoParameters(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(64, 10))

    def forward(self, x):
        return x.flatten(1) @ self.w


def nan_weight():
    m = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    with torch.no_grad():
        m[1].weight[0, 0] = float("nan")
    return m


@pytest.mark.parametrize(
    "model, says",
    [
        (Raises(ValueError("bad shape")), "ValueError"),
        (Raises(KeyError("x")), "KeyError"),
        (Returns("dict"), "returns a dict"),
        (Returns("tuple"), "returns a tuple"),
        (NoParameters(), "no trainable parameters"),
        (nan_weight(), "NaN or infinite initial weight"),
    ],
    ids=["ValueError", "KeyError", "a dict", "a tuple", "no parameters", "a NaN weight"],
)
def test_a_model_that_cannot_train_is_one_line_before_round_1(model, says):
    with pytest.raises(UserError) as err:
        stocfl.run(SHORT, federation=federation(), model=model, out=None, progress=False)
    assert says in one_line(err)


# 20, 21, 27: the data


def arrays(x=None, y=None):
    train, test, _ = rotated_clients(n_per_group=1, per_client=20, test=10)
    (x0, y0), t = train[0], test
    return [(x0 if x is None else x, y0 if y is None else y), train[1]], t


@pytest.mark.parametrize(
    "y, says",
    [
        (np.r_[np.zeros(19, int), 10**9], "beyond"),
        (np.r_[np.zeros(19, int), 2**62], "beyond"),
        (np.r_[np.zeros(19), 2.0**62], "beyond"),
        (np.r_[np.zeros(19, int), 255], "distinct labels"),
    ],
    ids=["10**9", "2**62", "2.0**62", "255"],
)
def test_a_stray_large_label_never_becomes_the_class_count(y, says):
    train, test = arrays(y=y)
    with pytest.raises(UserError) as err:
        stocfl.Federation.from_arrays(train, test)
    assert says in one_line(err)


def test_a_declared_class_count_keeps_sparse_labels_and_is_bounded():
    train, test = arrays(y=np.r_[np.zeros(19, int), 255])
    assert stocfl.Federation.from_arrays(train, test, n_classes=256).n_classes == 256
    with pytest.raises(UserError) as err:
        stocfl.Federation.from_arrays(*arrays(), n_classes=10**12)
    assert "n_classes" in one_line(err)


@pytest.mark.parametrize("how", ["meta", "sparse", "uint8"])
def test_inputs_that_are_not_dense_float_data_are_one_line(how):
    train, test = arrays()
    x = torch.as_tensor(train[0][0])
    x = {"meta": x.to("meta"), "sparse": x.flatten(1).to_sparse(), "uint8": (x * 255).to(torch.uint8)}[how]
    with pytest.raises(UserError) as err:
        stocfl.Federation.from_arrays([(x, train[0][1]), train[1]], test)
    assert how in one_line(err) or "dense" in one_line(err)


# 22, 26, 27: where a run goes, and how it is continued


def test_out_that_names_no_new_directory_is_one_line(tmp_path):
    afile = tmp_path / "a.txt"
    afile.write_text("keep me")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.md").write_text("mine")
    for out, says in (("", "names no directory"), (afile, "is a file"), (busy, "holds other files")):
        with pytest.raises(UserError) as err:
            stocfl.run(SHORT, out=out, progress=False)
        assert says in one_line(err)
    assert afile.read_text() == "keep me" and sorted(p.name for p in busy.iterdir()) == ["notes.md"]


def test_resume_overrides_given_as_one_string_are_one_line(tmp_path):
    stocfl.run(SHORT, out=tmp_path / "r", progress=False)
    with pytest.raises(UserError) as err:
        stocfl.resume(tmp_path / "r", overrides="run.rounds=3", progress=False)
    assert "list of 'key=value' strings" in one_line(err)


# 23: a loss that can be negative


def test_a_negative_loss_trains_and_is_evaluated():
    def shifted(logits, y):  # cross-entropy minus 5: the same gradients, negative values
        return nn.functional.cross_entropy(logits, y, reduction="none") - 5.0

    res = stocfl.run({"run": {"rounds": 3, "sample_rate": 0.5}}, federation=federation(), loss=shifted, progress=False)
    assert res.summary["accuracy"] is not None and all(m["accuracy"] is not None for m in res.metrics)


def test_an_empty_config_file_is_one_line_not_every_default(tmp_path, capsys):
    for text in ("", "# only a comment\n"):
        cfg = tmp_path / "empty.toml"
        cfg.write_text(text)
        capsys.readouterr()
        assert main(["run", str(cfg), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "sets nothing" in err, err
        assert not (tmp_path / "o").exists()


# 17, 9, 16: a fuzz over config text and --set items: a config is read or refused in one line


TOML_ATOMS = st.sampled_from(
    [
        "[",
        "]",
        "{",
        "}",
        "=",
        ",",
        '"',
        "'",
        "\n",
        "#",
        ".",
        "-",
        "run",
        "rounds",
        "scenario",
        "algorithm",
        "name",
        "1",
        "1e400",
        "inf",
        "nan",
        "true",
        "\\u0000",
        "\x00",
        "\x7f",
        "\ud800",
        "😀",
        "é",
        "\t",
        " ",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(TOML_ATOMS | st.text(max_size=8), max_size=60),
    depth=st.integers(0, 40),
)
def test_any_config_text_is_read_or_refused_in_one_line(tmp_path_factory, parts, depth):
    from stocfl.errors import UserError
    from stocfl.experiment import configure

    text = "".join(parts) + "\n[run]\nrounds = " + "[" * depth + "1" + "]" * depth + "\n"
    path = tmp_path_factory.mktemp("c") / "c.toml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        configure.load(str(path))
    except UserError as err:
        assert "\n" not in str(err) and str(err), repr(str(err))
    for item in (text, "".join(parts), f"run.rounds={'[' * depth}1{']' * depth}", f"{''.join(parts)}=1"):
        try:
            configure.load(None, [item])
        except UserError as err:
            assert "\n" not in str(err) and str(err), repr(str(err))
