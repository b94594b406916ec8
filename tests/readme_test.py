"""The README's code runs: each python block is executed and prints the text block after it;
each shell block names files, make targets and config fields that exist; links resolve."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from ebpo_jax.config import default_config
from ebpo_jax.config import doc as config_doc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.DOTALL | re.MULTILINE)


def blocks(path: str = README) -> list[tuple[str, str, str | None, int]]:
    """(language, code, the ```text block right after it or None, line) of each fenced block."""
    text = pathlib.Path(path).read_text()
    found = [(m.group(1), m.group(2), m.start(), m.end()) for m in FENCE.finditer(text)]
    out = []
    for i, (lang, code, start, end) in enumerate(found):
        nxt = found[i + 1] if i + 1 < len(found) else None
        shown = nxt[1] if nxt and nxt[0] == "text" and not text[end : nxt[2]].strip() else None
        out.append((lang, code, shown, text.count("\n", 0, start) + 1))
    return out


# A block that builds a model compiles a sampler: tens of seconds on a loaded CPU.
PYTHON = [
    pytest.param(code, shown, line, marks=[pytest.mark.slow] if "models." in code else [])
    for lang, code, shown, line in blocks()
    if lang == "python"
]
SHELL = [(code, line) for lang, code, _, line in blocks() if lang == "bash"]


@pytest.mark.parametrize("code,shown,line", PYTHON, ids=[f"line{p.values[2]}" for p in PYTHON])
def test_python_block_runs_and_prints_what_the_readme_shows(code, shown, line, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"README line {line}:\n{out.stderr[-3000:]}"
    assert shown is not None, f"README line {line}: no ```text block with its output after it"
    assert out.stdout.rstrip() == shown.rstrip(), f"README line {line}"


def _fields() -> set[str]:
    return {n for n, _ in config_doc._leaves(default_config())}


def test_shell_blocks_name_files_targets_and_fields_that_exist():
    fields, makefile = _fields(), pathlib.Path(ROOT, "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.MULTILINE))
    for code, line in SHELL:
        for path in re.findall(r"\b((?:experiments|benchmarks|configs)/[\w/]+\.py)", code):
            assert os.path.exists(os.path.join(ROOT, path)), f"README line {line}: {path}"
        for name in re.findall(r"--config\.([\w.]+)=", code):
            open_dict = name.startswith(("model.overrides.", "estimator_options."))
            assert name in fields or open_dict, f"README line {line}: no config field {name}"
        for target in re.findall(r"^make ([\w-]+)", code, re.MULTILINE):
            assert target in targets, f"README line {line}: no make target {target}"


def test_relative_links_resolve():
    for page in [README, *(os.path.join(ROOT, "docs", p) for p in os.listdir(ROOT + "/docs"))]:
        text = pathlib.Path(page).read_text()
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
            path = os.path.normpath(os.path.join(os.path.dirname(page), target))
            assert os.path.exists(path), f"{page}: link {target} does not resolve"
