"""The API reference is current, and every public function it documents is typed."""

import ast
import pathlib
import subprocess
import sys

import ebpo_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import api_doc


def test_docs_api_md_is_current():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "api_doc.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _public_defs(module: str):
    tree = ast.parse(api_doc.path_of(module).read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and api_doc.is_public(node.name):
            yield node.name, node
        if isinstance(node, ast.ClassDef) and api_doc.is_public(node.name):
            for fn in node.body:
                if not isinstance(fn, ast.FunctionDef):
                    continue
                if api_doc.is_public(fn.name) or fn.name in api_doc.DUNDERS:
                    yield f"{node.name}.{fn.name}", fn


def _untyped(fn: ast.FunctionDef) -> list[str]:
    """The parameters (and the return) of `fn` that carry no annotation."""
    a = fn.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    missing = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
    # A property's or __init__'s return is implied; everything else says what it returns.
    if fn.returns is None and fn.name != "__init__":
        missing.append("return")
    return missing


def test_every_public_function_is_typed():
    bad = [
        f"{module}.{name}: {', '.join(missing)}"
        for module, _ in api_doc.MODULES
        for name, fn in _public_defs(module)
        if (missing := _untyped(fn))
    ]
    assert not bad, "untyped:\n" + "\n".join(bad)


def test_the_typing_scan_finds_what_it_looks_for():
    f, g = ast.parse("def f(a, *, b: int, **kw) -> int: ...\ndef g(self, x: int): ...").body
    assert _untyped(f) == ["a", "kw"] and _untyped(g) == ["return"]


def test_version_is_declared_once_and_packaged_with_py_typed():
    setup = (ROOT / "setup.py").read_text()
    assert 'version="' not in setup and "version=VERSION" in setup
    assert ebpo_jax.__version__ in (ROOT / "CHANGELOG.md").read_text()
    assert (ROOT / "ebpo_jax" / "py.typed").exists() and '"py.typed"' in setup
