"""experiments/plot_run.py: one run's curves as a PNG, its path printed; one-line errors."""

import json
import os
import sys

import matplotlib.image
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))
import plot_run

from ebpo_jax.runtime import shell


def test_plot_writes_a_png_of_the_six_curves_and_prints_its_path(tmp_path, capsys):
    rows = [{"step": 0, "eval/pass@1": 0.25}]
    for s in range(1, 6):
        row = {n: 0.1 * s for n, _ in plot_run.PANELS if n != "eval/pass@1"}
        rows.append({"step": s, **row, "actor/kl": None})  # a skipped value is left out
    rows[-1]["eval/pass@1"] = 0.5
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "curves.png")
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 500 and image.shape[1] > 1000
    assert plot_run.series(rows, "eval/pass@1") == ([0, 5], [0.25, 0.5])
    assert plot_run.series(rows, "actor/kl") == ([], [])


def test_not_a_workdir_is_a_one_line_error(tmp_path, capsys):
    assert plot_run.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_a_panel_whose_term_is_off_says_so_instead_of_a_flat_zero(tmp_path, capsys):
    rows = [{"step": s, "reward/mean": 0.5, "actor/kl": 0.0} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"loss": {"kl_coef": 0.0}}))
    notes = plot_run.notes(rows, plot_run.run_config(str(tmp_path)))
    assert notes["actor/kl"] == "KL off (loss.kl_coef=0)"
    assert notes["eval/pass@1"] == "no eval/pass@1 yet" and "reward/mean" not in notes
    assert "actor/kl" not in plot_run.notes(rows, {"loss": {"kl_coef": 0.01}})  # on: a curve
    assert "actor/kl" not in plot_run.notes(rows, {})  # no config.json: the values as logged
    assert plot_run.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves.png")


def test_help_says_how_a_fresh_shell_runs_it(capsys):
    with pytest.raises(SystemExit) as e:
        plot_run.main(["--help"])
    assert e.value.code == 0
    run_as = shell.Shell.here().script("experiments/plot_run.py", "WORKDIR")
    assert f"\nRun as: {run_as}\n" in capsys.readouterr().out
