"""One-line docs of the config fields, read from the comments where they are declared.

Each field's doc is the comment on its line in `config.default_config` (or
`data.config.data_config`), else the comment lines right above it: the defaults and their
docs stay in one place, and `train.py --list_config` prints them.
"""

import ast
import inspect
import io
import tokenize

import ml_collections

from ebpo_jax.config import OPEN_DICTS

# The functions that declare the schema, and where their ConfigDict sits in the config.
_DECLARERS = (
    ("ebpo_jax.config", "default_config", ""),
    ("ebpo_jax.data.config", "data_config", "data."),
)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment text on that line (without '#')."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _target(node: ast.expr) -> str | None:
    """ "x.y" for the assignment target `c.x.y`, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and parts else None


def _doc(stmt: ast.stmt, comments: dict[int, str], lines: list[str]) -> str:
    """The comment inside the statement's lines, else the comment block right above it."""
    inside = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
    if inside:
        return " ".join(inside)
    above, n = [], stmt.lineno - 1
    while n >= 1 and lines[n - 1].strip().startswith("#"):
        above.insert(0, comments.get(n, ""))
        n -= 1
    return " ".join(above)


def declared_docs() -> dict[str, str]:
    """Dotted field name -> one-line doc ("" where the declaration has no comment)."""
    import importlib

    out = {}
    for module_name, fn_name, prefix in _DECLARERS:
        fn = getattr(importlib.import_module(module_name), fn_name)
        source = inspect.getsource(inspect.getmodule(fn))
        comments, lines = _comments(source), source.splitlines()
        tree = ast.parse(source)
        body = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == fn_name)
        for stmt in ast.walk(body):
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
                name = _target(stmt.targets[0])
                if name is not None:
                    out[prefix + name] = _doc(stmt, comments, lines)
    return out


def _leaves(config, prefix: str = ""):
    """(dotted name, value) of every non-dict field, in declaration order."""
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict) and len(value):
            yield from _leaves(value, f"{prefix}{key}.")
        elif not isinstance(value, ml_collections.ConfigDict):
            yield prefix + key, value


def _open_dict_doc(name: str, docs: dict[str, str]) -> str:
    """A field inside a free-form dict (estimator_options, model.overrides): the dict's doc."""
    parent = next((p for p in OPEN_DICTS if name.startswith(p + ".")), None)
    return f"(in {parent}: {docs.get(parent, '')})" if parent else ""


def describe(config) -> str:
    """Every field of `config`: `name = value  # doc`, one per line."""
    docs = declared_docs()
    rows = [(n, repr(v.to_dict() if hasattr(v, "to_dict") else v)) for n, v in _leaves(config)]
    width = max(len(f"{n} = {v}") for n, v in rows)
    out = []
    for name, value in rows:
        doc = docs.get(name) or _open_dict_doc(name, docs)
        out.append(f"{name} = {value}".ljust(width) + (f"  # {doc}" if doc else ""))
    return "\n".join(out)
