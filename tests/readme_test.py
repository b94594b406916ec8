"""The README's code runs: each python block is executed and prints the text block after it;
each shell block names files, make targets and config fields that exist; links resolve."""

import importlib.util
import os
import pathlib
import re
import shlex
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


def _train_commands() -> list[tuple[int, list[str]]]:
    """(README line, flags) of each training command in a shell block (`make train ARGS=...`
    or `experiments/train.py ...`), continuation lines joined, comments dropped."""
    found = []
    for code, line in SHELL:
        for i, text in enumerate(code.replace("\\\n", " ").splitlines()):
            words = shlex.split(text, comments=True)
            if words[:2] == ["make", "train"]:
                args = [w.removeprefix("ARGS=") for w in words[2:] if w.startswith("ARGS=")]
                found.append((line + 1 + i, shlex.split(" ".join(args))))
            elif any(w.endswith("experiments/train.py") for w in words):
                at = next(j for j, w in enumerate(words) if w.endswith("experiments/train.py"))
                found.append((line + 1 + i, words[at + 1 :]))
    return found


def _run_of(flags: list[str]) -> tuple[str, tuple]:
    """(workdir, what makes the run: config file and the overrides a resume compares)."""
    from ebpo_jax.runtime.workdir import HARMLESS_FIELDS as HARMLESS

    config = next((f.split("=", 1)[1] for f in flags if f.startswith("--config=")), None)
    path, _, variant = (config or "configs/tiny.py").partition(":")
    module_spec = importlib.util.spec_from_file_location("readme_config", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    overrides = dict(
        f[len("--config.") :].split("=", 1) for f in flags if f.startswith("--config.")
    )
    workdir = overrides.get("workdir") or module.get_config(*[variant] if variant else []).workdir
    kept = tuple(sorted((k, v) for k, v in overrides.items() if not k.startswith(HARMLESS)))
    return workdir, (path, variant, kept)


def test_readme_training_commands_do_not_share_a_workdir():
    """Each command pasted as shown starts or resumes its own run: two different runs in one
    workdir would have the second refused."""
    runs: dict[str, dict] = {}
    for line, flags in _train_commands():
        if any(f in ("--help", "--list_config") for f in flags):
            continue
        workdir, run = _run_of(flags)
        runs.setdefault(workdir, {}).setdefault(run, line)
    shared = {w: sorted(r.values()) for w, r in runs.items() if len(r) > 1}
    assert not shared, f"README lines sharing a workdir with different runs: {shared}"


PKG = pathlib.Path(ROOT, "ebpo_jax")
FOLDERS = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
# `ebpo_jax/x.py`, `ebpo_jax/a/b.py` or a package folder's file written as `trainer/x.py`; not
# another project's path (`verl/trainer/...`).
PATH = re.compile(rf"(?<![\w/.-])(?:ebpo_jax/[\w/]*|(?:{'|'.join(FOLDERS)})/[\w/]*)\w\.py\b")
DOTTED = re.compile(r"\bebpo_jax(?:\.[A-Za-z]\w*)+")
PAGES = [README, *sorted(str(p) for p in pathlib.Path(ROOT, "docs").glob("*.md"))]


def _resolves(dotted: str) -> bool:
    """`ebpo_jax.a.b.name`: its modules exist and the first name after them is in the module's
    text (no import: the trainer's modules import jax and flax)."""
    path, rest = PKG, dotted.split(".")[1:]
    while rest:
        if (path / rest[0]).is_dir():
            path = path / rest.pop(0)
        elif path.is_dir() and (path / f"{rest[0]}.py").is_file():
            path = path / f"{rest.pop(0)}.py"
        else:
            break
    if not rest:
        return True
    source = path / "__init__.py" if path.is_dir() else path
    return re.search(rf"\b{rest[0]}\b", source.read_text()) is not None


def test_package_paths_and_names_in_the_docs_exist():
    """README.md and docs/*.md name only files and modules that exist after the moves."""
    for page in PAGES:
        text = pathlib.Path(page).read_text()
        for path in PATH.findall(text):
            full = path if path.startswith("ebpo_jax/") else f"ebpo_jax/{path}"
            assert os.path.exists(os.path.join(ROOT, full)), f"{os.path.basename(page)}: {path}"
        for name in set(DOTTED.findall(text)):
            assert _resolves(name), f"{os.path.basename(page)}: {name}"


def _layout() -> dict[str, str]:
    """{entry: its description} of the README layout map's `ebpo_jax/` tree."""
    text = pathlib.Path(README).read_text()
    block = text[text.index("## Layout") :].split("```")[1]
    tree = block[block.index("\nebpo_jax/") :].split("\n", 2)[2]
    entries: dict[str, str] = {}
    key = None
    for line in tree.splitlines():
        if not line.startswith(" "):
            break
        if not line.startswith("   "):  # "  name   description"
            key = line.split()[0]
            entries[key] = line.strip()[len(key) :].strip()
        elif key is not None:  # the description goes on
            entries[key] += " " + line.strip()
    return entries


def test_the_layout_map_shows_every_folder_and_only_files_that_exist():
    entries = _layout()
    missing = set(FOLDERS) - {e.rstrip("/") for e in entries}
    assert not missing, f"the layout map lacks {sorted(missing)}"
    for key, text in entries.items():
        folder = PKG / key if key.endswith("/") else PKG
        for name in re.findall(r"(?<![\w/])(\w+\.py)\b", f"{key} {text}"):
            assert (folder / name).exists() or (PKG / name).exists(), f"layout {key}: {name}"
