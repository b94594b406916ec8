"""Limits on the package's source, read from its syntax trees: short functions with short
parameter lists, no private names across modules, nothing done at import time."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ebpo_jax"
MAX_LINES = 60  # a function's lines, decorators and docstring included
MAX_PARAMS = 9  # a spec counts as one; self and cls do not count
# Functions at 8 or 9 parameters: a list that wants a type. 36 on b01c5f5, 28 on d717065,
# 6 once run_grid took a Selection and the built-in surrogates named only the options they
# read: the stable public signatures (eb_advantage, importance.is_correction,
# sampler.generate, models.forward, forward_cached) and clip_cov, which reads every option.
MAX_CROWDED = 10

# NamedTuple's public methods and fields start with an underscore.
_NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}

# Calls that change process-wide state; none may run when a module is imported.
_GLOBAL_CALLS = (
    "os.environ.",
    "os.putenv",
    "jax.config.update",
    "matplotlib.use",
    "logging.basicConfig",
    "warnings.filterwarnings",
    "warnings.simplefilter",
)
_LOGGING_METHODS = (".addHandler", ".addFilter", ".setLevel")  # on any logger or handler


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path))


def _size(fn: ast.FunctionDef) -> tuple[int, int]:
    """(lines, parameters) of one def."""
    a = fn.args
    params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    params += (a.vararg is not None) + (a.kwarg is not None)
    if a.args and a.args[0].arg in ("self", "cls"):
        params -= 1
    return fn.end_lineno - fn.lineno + 1, params


def test_no_function_is_long_or_takes_many_parameters():
    """No def in ebpo_jax/ over 60 lines or with 10 or more parameters."""
    bad = []
    for rel, tree in _modules():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines, params = _size(fn)
            if lines > MAX_LINES or params > MAX_PARAMS:
                bad.append(f"{rel}:{fn.lineno} {fn.name}: {lines} lines, {params} parameters")
    assert not bad, "over the limits:\n" + "\n".join(bad)


def test_few_functions_crowd_the_parameter_limit():
    """At most MAX_CROWDED defs in ebpo_jax/ take 8 or 9 parameters (*args, **kwargs count)."""
    crowded = [
        f"{rel}:{fn.lineno} {fn.name}: {_size(fn)[1]} parameters"
        for rel, tree in _modules()
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and _size(fn)[1] >= 8
    ]
    assert len(crowded) <= MAX_CROWDED, (
        f"{len(crowded)} functions take 8 or 9 parameters (at most {MAX_CROWDED}); give the "
        "arguments a type (a small frozen spec the caller has) rather than adding one:\n"
        + "\n".join(crowded)
    )


def test_the_size_measure_counts_what_it_should():
    src = "def f(a, b=1, *args, c, **kw):\n    return a\n\n\ndef g(self, x):\n    pass\n"
    f, g = ast.parse(src).body
    assert _size(f) == (2, 5) and _size(g) == (2, 1)


def _private_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of every `from ebpo_jax... import _x` and `module._x` of a package module."""
    modules, out = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or "ebpo_jax" in (node.module or "")):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append((node.lineno, f"from {node.module} import {a.name}"))
                modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("ebpo_jax")}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr in _NAMEDTUPLE_API:
            continue
        base = ast.unparse(node.value)
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        if private and base.split(".")[0] in modules:
            out.append((node.lineno, f"{base}.{node.attr}"))
    return out


def test_no_private_name_is_used_across_modules():
    bad = [f"{rel}:{n} {text}" for rel, tree in _modules() for n, text in _private_uses(tree)]
    assert not bad, "private names used from another module:\n" + "\n".join(bad)


def _import_time_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, text) of each global-state change that runs on import: module and class bodies,
    not function bodies."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.ClassDef):
            todo += node.body
            continue
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ":
                    out.append((node.lineno, ast.unparse(t)))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.startswith(_GLOBAL_CALLS) or name.endswith(_LOGGING_METHODS):
                out.append((node.lineno, name))
        todo += list(ast.iter_child_nodes(node))
    return out


def test_importing_the_package_changes_no_global_state():
    bad = [f"{rel}:{n} {text}" for rel, tree in _modules() for n, text in _import_time_calls(tree)]
    assert not bad, "runs on import (move it into the function that needs it):\n" + "\n".join(bad)


def test_the_scans_find_what_they_look_for():
    src = (
        "import os\nfrom ebpo_jax import spec\nfrom ebpo_jax.spec import _hidden, Public\n"
        "os.environ['A'] = '1'\nos.environ.setdefault('B', '1')\n"
        "class C:\n    jax.config.update('x', 1)\n"
        "logging.getLogger('absl').addFilter(f)\n"
        "def f():\n    os.environ['D'] = '1'\n    return spec._check(Public._fields)\n"
    )
    tree = ast.parse(src)
    assert _private_uses(tree) == [(3, "from ebpo_jax.spec import _hidden"), (11, "spec._check")]
    assert sorted(_import_time_calls(tree)) == [
        (4, "os.environ['A']"),
        (5, "os.environ.setdefault"),
        (7, "jax.config.update"),
        (8, "logging.getLogger('absl').addFilter"),
    ]
