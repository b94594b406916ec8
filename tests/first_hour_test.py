"""What a new user meets first: the closing summary on fresh, resumed and finished runs, the
progress lines of a run without a terminal, --help and --list_config."""

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from configs import micro
from ebpo_jax.config import default_config
from ebpo_jax.config import doc as config_doc
from ebpo_jax.runtime import progress, shell
from ebpo_jax.trainer import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_py(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), *flags]
    return subprocess.run(
        cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_help_exits_0_and_says_how_to_list_the_config_fields():
    out = _train_py("--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--list_config" in out.stdout and "--nocompilation_cache" in out.stdout
    assert "Exit status:" in out.stdout  # the scheme, stated in ebpo_jax/cli.py
    in_root = dataclasses.replace(shell.Shell.here(), cwd=ROOT)  # where _train_py runs it
    assert f"Run as: {in_root.script('experiments/train.py')} " in out.stdout
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "eval.py"), "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert out.returncode == 0 and "--workdir: A training run's folder" in out.stdout


def test_list_config_prints_every_field_with_its_value_and_doc():
    out = _train_py("--config=configs/micro.py", "--config.total_steps=7", "--list_config")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" = ", 1) for line in out.stdout.splitlines())
    names = {n for n, _ in config_doc._leaves(micro.get_config())}
    assert set(lines) == names
    assert lines["total_steps"].startswith("7 ") and "# RL steps" in lines["total_steps"]
    assert lines["workdir"].startswith("'runs/micro'")
    assert all("  # " in v for v in lines.values()), [n for n, v in lines.items() if "#" not in v]


def test_every_declared_field_has_a_one_line_doc():
    docs = config_doc.declared_docs()
    missing = [n for n, _ in config_doc._leaves(default_config()) if not docs.get(n)]
    # The free-form dicts' entries are documented by the dict (and by the estimator / model).
    assert [n for n in missing if not n.startswith(("estimator_options.", "model."))] == []


def test_text_progress_prints_every_n_steps_and_every_t_seconds():
    now, lines = [0.0], []
    p = progress.TextProgress(
        100, initial=10, every=10, every_s=30.0, print_fn=lines.append, clock=lambda: now[0]
    )
    p.compiling()
    for step in range(10, 25):  # step 11 compiles (60 s), then 2 s a step
        now[0] += 60.0 if step == 10 else 2.0
        row = {"reward/mean": 0.5, "perf/tokens_per_s": 1234.0}
        if step == 19:
            row["eval/pass@1"] = 0.375
        p.update(step, row)
    assert lines[0] == "step 11/100: compiling the train step ..."
    assert lines[1] == "step 11/100 | reward 0.500 | 1234 tok/s"  # 60 s since the last line
    # Step 20: every 10 steps; ETA from the 9 steps after the compiled one (2 s each).
    assert (
        lines[2] == "step 20/100 | reward 0.500 | pass@1 37.5% (step 20) | 1234 tok/s | ETA 2m40s"
    )
    assert len(lines) == 3
    now[0] += 31.0  # a slow step: a line after 30 s even between multiples of 10
    p.update(25, {"reward/mean": 0.25})
    assert lines[3].startswith("step 26/100 | reward 0.250 | pass@1 37.5% (step 20) | nan tok/s")
    assert isinstance(progress.progress(5, initial=0, every=1, every_s=1, tty=False), type(p))


def _counting_evaluator(monkeypatch):
    """build_task with an evaluate() whose score is its call count / 10: every value differs."""
    calls = []
    build = loop.build_task

    def build_task(*a, **k):
        task = build(*a, **k)
        return task._replace(evaluate=lambda params: calls.append(1) or {"test": len(calls) / 10})

    monkeypatch.setattr(loop, "build_task", build_task)
    return calls


def _micro(workdir, total_steps):
    c = micro.get_config()
    c.unlock()
    c.workdir, c.total_steps, c.eval_every, c.checkpoint_every = str(workdir), total_steps, 2, 1
    c.mesh.devices = 1  # conftest fakes 8 CPU devices
    return c


def _evals(workdir) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/pass@1"]) for r in rows if "eval/pass@1" in r]


def _score(s) -> tuple:
    return s["pass@1_start"], s["pass@1_end"], s["pass@1_end_step"]


@pytest.mark.slow  # a step compile; train_cli_test checks a fresh and a finished CLI run
def test_summary_is_the_latest_evaluation_on_fresh_and_finished_runs(tmp_path, monkeypatch):
    calls = _counting_evaluator(monkeypatch)
    c = _micro(tmp_path, 2)
    assert _score(loop.train(c, log=print)) == (0.1, 0.2, 2)  # fresh: evals at steps 0 and 2
    s = loop.train(c, log=print)  # finished: the last score from metrics.jsonl, no evaluation
    assert _score(s) == (0.1, 0.2, 2) and len(calls) == 2 and s["step"] == 2
    assert not os.path.exists(tmp_path / ".lock")
    # A finished run whose last step has no evaluation (stopped, then total_steps lowered to
    # it): evaluated once at the end.
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    del last["eval/pass@1"]
    (tmp_path / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")
    assert _score(loop.train(c, log=print)) == (0.1, 0.3, 2) and len(calls) == 3


@pytest.mark.slow  # two step compiles: ~45 s on a loaded 2-core CPU
def test_summary_is_the_latest_evaluation_after_a_stop_and_resumes(tmp_path, monkeypatch):
    calls = _counting_evaluator(monkeypatch)
    s = loop.train(_micro(tmp_path, 2), log=print, stop_after=1)  # stopped before an eval
    assert _score(s) == (0.1, 0.1, 0) and s["step"] == 1 and s["stopped_early"]
    s = loop.train(_micro(tmp_path, 1), log=print)  # finished at an unevaluated step
    assert _score(s) == (0.1, 0.2, 1) and len(calls) == 2
    s = loop.train(_micro(tmp_path, 2), log=print)  # a resume that trains and evaluates step 2
    assert _score(s) == (0.1, 0.3, 2)
    s = loop.train(_micro(tmp_path, 2), log=print)  # finished: from metrics.jsonl
    assert _score(s) == (0.1, 0.3, 2) and len(calls) == 3
    assert _evals(tmp_path) == [(0, 0.1), (2, 0.3)]


def test_micro_summary_says_it_has_no_warm_start():
    s = {
        "pass@1_start": 0.0,
        "pass@1_end": 0.0,
        "pass@1_end_step": 4,
        "step": 4,
        "stopped_early": False,
        "wall_time_s": 3.0,
        "workdir": "w",
        "metrics": "w/metrics.jsonl",
        "checkpoints": "w/checkpoints",
    }
    text = progress.summary(s, micro.get_config())
    assert "no warm start" in text.splitlines()[0] and "(step 4)" in text
    assert "plot: " in text and "experiments/plot_run.py w\n" in text


def _summary(workdir: str, sh) -> dict[str, str]:
    """The closing lines of a finished run in `workdir`, by their label ("plot", ...)."""
    s = {"pass@1_start": 0.1, "pass@1_end": 0.2, "pass@1_end_step": 2, "step": 2}
    s |= {"stopped_early": False, "wall_time_s": 3.0, "workdir": workdir}
    s |= {"metrics": f"{workdir}/metrics.jsonl", "checkpoints": f"{workdir}/checkpoints"}
    lines = progress.summary(s, micro.get_config(), sh).splitlines()[2:]
    return dict(line.split(": ", 1) for line in lines)


def test_printed_hints_name_the_venvs_interpreter_and_tools(tmp_path):
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "tensorboard").write_text("")
    venv = shell.Shell(str(tmp_path), str(bin_dir / "python"), venv=True)
    hints = _summary("runs/my run", venv)
    script = os.path.join(ROOT, "experiments", "plot_run.py")  # not under tmp_path: absolute
    assert hints["plot"] == f".venv/bin/python {script} 'runs/my run'"
    assert hints["tensorboard"] == ".venv/bin/tensorboard --logdir 'runs/my run'"
    in_repo = shell.Shell(ROOT, os.path.join(ROOT, ".venv", "bin", "python"), venv=True)
    assert _summary("w", in_repo)["plot"] == ".venv/bin/python experiments/plot_run.py w"
    # No venv: a program PATH finds by its name, else by its path; no such tool: its name.
    found = shutil.which("sh")
    assert shell.Shell(str(tmp_path), found, venv=False).python() == "sh"
    no_venv = shell.Shell(str(tmp_path), str(bin_dir / "python"), venv=False)
    assert no_venv.tool("tensorboard") == ".venv/bin/tensorboard" and no_venv.tool("nope") == "nope"


def test_the_printed_plot_command_runs_in_a_fresh_shell(tmp_path):
    rows = [{"step": 0, "eval/pass@1": 0.25}, {"step": 1, "reward/mean": 0.5, "actor/kl": 0.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hints = _summary(str(tmp_path), shell.Shell.here())
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/"), "JAX_PLATFORMS": "cpu"}
    if "PYTHONPATH" in os.environ:  # this checkout, not an installed copy
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    cmd = shlex.split(hints["plot"])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(tmp_path / "curves.png")
    tool = shlex.split(hints["tensorboard"])[0]
    assert "/" in tool or shutil.which(tool, path=env["PATH"]), hints["tensorboard"]


def test_a_resume_that_trains_nothing_says_so_in_one_line():
    s = {
        "pass@1_start": 0.25,
        "pass@1_end": 0.37,
        "pass@1_end_step": 250,
        "step": 250,
        "resumed_from": 250,
        "stopped_early": False,
        "wall_time_s": 1.0,
        "workdir": "w",
        "metrics": "w/metrics.jsonl",
        "checkpoints": "w/checkpoints",
    }
    lines = progress.summary(s, micro.get_config()).splitlines()
    assert lines[1] == "nothing to train: the run is at step 250 (raise --config.total_steps)"
    assert not any(line.startswith("trained to step") for line in lines)
    assert "trained to step 250, 3 s" in progress.summary(
        {**s, "resumed_from": 240, "wall_time_s": 3.0}, micro.get_config()
    )


def test_the_make_train_venv_gets_no_libtpu_and_make_test_its_own_venv():
    setup = pathlib.Path(ROOT, "setup.py").read_text()
    train = setup[setup.index("TRAIN = [") : setup.index("setuptools.setup(")]  # the [train] extra
    assert "tpu" not in train and "torch" not in train
    assert "tensorboard>=" in train  # `tensorboard --logdir` works from the train venv
    make = pathlib.Path(ROOT, "Makefile").read_text()
    venvs = dict(re.findall(r"^(\w*VENV) := (\S+)", make, re.MULTILINE))
    assert venvs["VENV"] != venvs["TEST_VENV"]
    installs = re.findall(
        r"^\t\$\((\w+)\)/bin/pip install -q(?: -c \$\(CONSTRAINTS\))? -e (\S+)$", make, re.MULTILINE
    )
    assert ("VENV", "'.[train]'") in installs and ("TEST_VENV", "'.[test]'") in installs
    assert all(venv == "TEST_VENV" for venv, extra in installs if "test" in extra)


def test_the_venv_installs_drop_setuptools_editable_banner_and_nothing_else():
    make = pathlib.Path(ROOT, "Makefile").read_text()
    targets, value = re.search(r"^(.+): export PYTHONWARNINGS = (.+)$", make, re.MULTILINE).groups()
    assert {"$(TRAIN_STAMP)", "$(TEST_STAMP)"} <= set(targets.split())
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("no setuptools here to emit its banner")
    emit = (
        "import warnings; from setuptools.warnings import InformationOnly; "
        "InformationOnly.emit('Editable installation.', 'Please be careful with folders'); "
        "warnings.warn('another warning', UserWarning)"
    )
    env = dict(os.environ, PYTHONWARNINGS=value)  # what pip's build backend process inherits
    out = subprocess.run(
        [sys.executable, "-c", emit], env=env, capture_output=True, text=True, check=True
    )
    assert "Editable installation" not in out.stderr and "another warning" in out.stderr


def test_compilation_cache_folder_is_the_users_and_configurable(tmp_path):
    from ebpo_jax.runtime import compile_cache

    assert compile_cache.default_dir({}) == os.path.join(
        os.path.expanduser("~"), ".cache", "ebpo_jax", "xla"
    )
    assert compile_cache.default_dir({"XDG_CACHE_HOME": "/c"}) == "/c/ebpo_jax/xla"
    assert compile_cache.default_dir({compile_cache.ENV: str(tmp_path)}) == str(tmp_path)


def test_orbax_item_metadata_warning_is_dropped_and_others_kept(tmp_path):
    import logging

    from ebpo_jax.runtime.checkpoint import Checkpointer

    Checkpointer(str(tmp_path / "ckpt")).close()  # installs the filter on the absl logger
    logger, seen = logging.getLogger("absl"), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        missing = "Metadata file does not exist: %s"
        logger.warning(missing, tmp_path / "ckpt/4/state/_CHECKPOINT_METADATA")
        logger.warning(missing, tmp_path / "ckpt/4/other_file")
    finally:
        logger.removeHandler(handler)
    assert seen == [f"Metadata file does not exist: {tmp_path}/ckpt/4/other_file"]
