"""One-line docs of the config fields, read from where they are declared (ebpo_jax.schema).

Each field's doc is the `doc` of its `schema.setting(...)`: the default, doc and check stay
in one place, and `train.py --list_config` prints them.
"""

import ml_collections

from ebpo_jax import schema
from ebpo_jax.schema import OPEN_DICTS


def declared_docs() -> dict[str, str]:
    """Dotted field name -> one-line doc (sections' names included)."""
    return schema.docs()


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
