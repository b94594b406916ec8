"""The core install: `import ebpo_jax` and its maths need only setup.py's CORE requirements, and
the built wheel installs into a fresh venv without the trainer's dependencies and runs the
README's estimator block there."""

import ast
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from readme_test import blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE_MODULES = (
    "ebpo_jax",
    "ebpo_jax.advantages",
    "ebpo_jax.losses",
    "ebpo_jax.importance",
    "ebpo_jax.integrations.stream",
)
TRAINER_ONLY = ("flax", "optax", "orbax-checkpoint", "transformers", "datasets", "chex", "torch")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """`cmd`'s completed process, its output captured as text; fails the test with its stderr."""
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    assert out.returncode == 0, (
        f"{' '.join(cmd[:4])} exited {out.returncode}:\n{out.stderr[-3000:]}"
    )
    return out


def core_requirements() -> list[str]:
    """setup.py's CORE list, read from its source."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "CORE":
            return ast.literal_eval(node.value)
    raise ValueError("setup.py: no CORE list")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def closure(requirements: list[str]) -> set[str]:
    """The distributions these requirements pull in, transitively (extras not followed)."""
    seen, todo = set(), [_name(r) for r in requirements]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in importlib.metadata.requires(name) or []:
            if "extra ==" not in req:
                todo.append(_name(req))
    return seen


def added_distributions(*steps: str) -> list[set[str]]:
    """Per step after the first: the distributions of the non-stdlib top-level modules that
    running it loads beyond the steps before it (one fresh interpreter)."""
    code = "import sys\n" + "\n".join(
        f"seen = set(sys.modules)\n{step}\nprint(sorted(set(sys.modules) - seen))" for step in steps
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    out = run([sys.executable, "-c", code], env=env)
    owners = importlib.metadata.packages_distributions()
    found = []
    for line in out.stdout.strip().splitlines()[-len(steps) + 1 :]:
        tops = {m.split(".")[0] for m in ast.literal_eval(line)}
        tops -= set(sys.stdlib_module_names) | {"ebpo_jax"}
        found.append({_name(d) for t in tops if not t.startswith("_") for d in owners.get(t, [t])})
    return found


# jax itself imports what it finds installed (etils, filelock, typing_extensions, ...): only
# what importing ebpo_jax adds beyond that counts, and it must lie in CORE's closure.
JAX_ALONE = "import jax, jax.numpy as jnp, numpy\njnp.zeros(2).sum()"


def test_the_core_modules_import_only_the_core_requirements():
    core = "\n".join(f"import {m}" for m in CORE_MODULES)
    ours, chex = added_distributions(JAX_ALONE, core, "import chex")
    allowed = closure(core_requirements())
    assert not ours - allowed, f"importing the core loads {sorted(ours - allowed)}, not in CORE"
    assert "chex" in chex - allowed  # the scan sees a trainer dependency when one is imported


def test_the_requirement_closure_follows_dependencies_not_extras():
    assert len(readme_estimator_blocks()) == 2  # the estimator and the state's checkpoint
    deps = closure(["jax>=0.10"])
    assert {"jax", "jaxlib", "numpy", "ml-dtypes"} <= deps and "libtpu" not in deps
    assert "flax" not in closure(core_requirements())


def readme_estimator_blocks() -> list[tuple[str, str]]:
    """(code, the output it shows) of the python blocks in the README's estimator section."""
    text = (ROOT / "README.md").read_text().splitlines()
    start = text.index("## Using the estimator in your own JAX project") + 1
    end = next(n for n, line in enumerate(text[start:], start + 1) if line.startswith("## "))
    return [(c, shown) for lang, c, shown, n in blocks() if lang == "python" and start < n < end]


@pytest.mark.slow
def test_the_wheel_installs_without_the_trainer_and_runs_the_readme_block(tmp_path):
    dist, venv, src = tmp_path / "dist", tmp_path / "core", tmp_path / "src"
    # Built from a copy: setuptools writes build/ into the tree it builds.
    shutil.copytree(
        ROOT / "ebpo_jax", src / "ebpo_jax", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, src / name)
    wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*wheel, "-w", str(dist), str(src)], check=True, timeout=600)
    (whl,) = dist.glob("ebpo_jax-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # Without this suite's PYTHONPATH, which would show pip (and python) the checkout instead.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"JAX_PLATFORMS": "cpu"}
    pip = [py, "-m", "pip", "install", "-q", str(whl)]
    subprocess.run(pip, env=env, check=True, timeout=1800)
    listed = run([py, "-m", "pip", "list", "--format=json"], env=env)
    installed = {_name(p["name"]) for p in json.loads(listed.stdout)}
    assert "ebpo-jax" in installed and not installed & set(TRAINER_ONLY), sorted(installed)
    for code, shown in readme_estimator_blocks():
        out = run([py, "-c", code], cwd=tmp_path, env=env)
        assert out.stdout.rstrip() == shown.rstrip()
    timed = run([py, "-X", "importtime", "-c", "import ebpo_jax"], cwd=tmp_path, env=env)
    (line,) = [x for x in timed.stderr.splitlines() if x.rstrip().endswith("| ebpo_jax")]
    import_s = int(line.split("|")[1]) / 1e6  # cumulative: ebpo_jax and all it imports
    du = run(["du", "-sm", str(venv)])
    print(f"core venv {du.stdout.split()[0]} MB, import ebpo_jax {import_s:.2f} s")
