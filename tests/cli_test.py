"""ebpo_jax.cli: the exit-status scheme is stated once (docstring, --help, README) and each
status is what it says: 0 done, 1 the run cannot go on, 2 bad input."""

import os
import pathlib
import re
import sys

import pytest
from absl import app

from ebpo_jax import cli
from ebpo_jax.data import DataError
from ebpo_jax.models.hf import HFCheckpointError
from ebpo_jax.runtime.metrics import MetricsError
from ebpo_jax.runtime.workdir import WorkdirError
from ebpo_jax.runtime.workers import WorkerError
from ebpo_jax.schema import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stated(text: str) -> dict[int, str]:
    """{status: its line} of an "Exit status:" paragraph."""
    start = text.index("Exit status:")
    end = text.find("\n\n", start)
    block = text[start : end if end >= 0 else None]
    return {int(m[1]): m[2] for m in re.finditer(r"^\W*(\d)\W+(\w[^\n]*)", block, re.MULTILINE)}


def test_the_scheme_is_stated_in_the_docstring_and_the_readme():
    stated = _stated(cli._exit_scheme())
    assert set(stated) == {cli.EXIT_OK, cli.EXIT_FAILURE, cli.EXIT_USAGE}
    assert stated[0].startswith("done") and stated[2].startswith("bad input")
    readme = pathlib.Path(ROOT, "README.md").read_text()
    assert set(_stated(readme)) == set(stated)


def _status(monkeypatch, capsys, error: BaseException | None, argv=("train.py",)) -> int:
    """The exit status of cli.run over a main that raises `error` (or returns)."""

    def main(_):
        if error is not None:
            raise error

    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as e:
        cli.run(main)
    err = capsys.readouterr().err
    if error is not None:  # one line, no traceback
        assert err.startswith("error: ") and err.count("\n") == 1, err
    return e.value.code or 0


@pytest.mark.parametrize(
    "error,status",
    [
        (None, 0),
        (ConfigError("group_size must be >= 1, got 0"), 2),
        (DataError("data.path: /d.jsonl does not exist"), 2),
        (HFCheckpointError("/ckpt/config.json: no model_type"), 2),
        (app.UsageError("--src is required"), 2),
        (WorkdirError("workdir w is in use by pid 7"), 1),
        (MetricsError("cannot write w/metrics.jsonl"), 1),
        (WorkerError("the reward pool died"), 1),
        (OSError(28, "No space left on device", "w/metrics.jsonl"), 1),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, int) else str(v),
)
def test_each_status_is_what_the_scheme_says(monkeypatch, capsys, error, status):
    assert _status(monkeypatch, capsys, error) == status


def test_an_unknown_flag_is_bad_input(monkeypatch, capsys):
    assert _status(monkeypatch, capsys, None, argv=("train.py", "--no_such_flag=1")) == 2


def test_a_refused_resume_exits_1_in_one_line(monkeypatch, capsys, tmp_path):
    from configs import micro
    from ebpo_jax.trainer import loop

    row = '{"step": 0, "eval/pass@1": 0.5}\n'
    (tmp_path / "metrics.jsonl").write_text(row)  # metrics without a checkpoint
    c = micro.get_config()
    c.unlock()
    c.workdir, c.mesh.devices = str(tmp_path), 1
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit) as e:
        cli.run(lambda _: loop.train(c, log=print))
    assert e.value.code == cli.EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "restart=True" in err, err
    assert (tmp_path / "metrics.jsonl").read_text() == row and not (tmp_path / ".lock").exists()
