"""The training config as ml_collections: built from `ebpo_jax.schema`, validated once.

Config files start from `default_config()` and set fields (`c.loss.clip_low = 0.1`); the
command line overrides them (`--config.loss.clip_low=0.1`). Every field, its default, doc and
check are declared once, in `ebpo_jax.schema`; the checks that need several sections are in
`ebpo_jax.config.checks`.
"""

import dataclasses
import os
import typing

import ml_collections

from ebpo_jax import schema
from ebpo_jax.config import checks
from ebpo_jax.schema import OPEN_DICTS, ConfigError

__all__ = [
    "OPEN_DICTS",
    "ConfigError",
    "default_config",
    "finalize",
    "load_sibling",
    "validate",
    "validated",
]


def _optional_type(hint) -> type:
    """X of a declared `X | None`."""
    return next(t for t in typing.get_args(hint) if t is not type(None))


# The built-in estimators' keyword options and their types (X of schema.EstimatorOptions'
# `X | None`): typed None placeholders, so `--config.estimator_options.forgetting=0.95` works.
ESTIMATOR_OPTIONS = {
    name: _optional_type(hint)
    for name, hint in typing.get_type_hints(schema.EstimatorOptions).items()
    if name != "extra"
}


def _leaf(cls, f):
    """A field's ConfigDict value: its default, a typed placeholder, or an open dict."""
    if cls is schema.EstimatorOptions:
        return ml_collections.config_dict.placeholder(ESTIMATOR_OPTIONS[f.name])
    if isinstance(f.default, schema.Pairs):
        return ml_collections.ConfigDict()  # free-form: a config file adds entries
    return f.default


def _items(cls) -> list:
    """(name, value) of a section's ConfigDict in declaration order (flat sections inlined)."""
    out = []
    for f in dataclasses.fields(cls):
        sub = f.metadata.get("section")
        if sub is None:
            if f.name != "extra":  # EstimatorOptions.extra: the entries a config file adds
                out.append((f.name, _leaf(cls, f)))
        elif f.name in schema.FLAT:
            out += _items(sub)
        else:
            after = (
                [n for n, _ in out].index(f.metadata["after"]) + 1
                if f.metadata["after"]
                else len(out)
            )
            out.insert(after, (f.name, _configdict(sub)))
    return out


def _configdict(cls) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    for name, value in _items(cls):
        c[name] = value
    return c


def default_config() -> ml_collections.ConfigDict:
    """Every field the trainer reads, with defaults (from ebpo_jax.schema); config files start
    from this."""
    return _configdict(schema.Config)


def load_sibling(config_file: str, name: str):
    """The config module `name` next to `config_file` (config files are loaded by path, so a
    config that builds on another cannot import it as a package module)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(config_file)), name)
    spec = importlib.util.spec_from_file_location(
        f"ebpo_config_{os.path.basename(name)[:-3]}", path
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Lock a config so that assigning a misspelt field raises."""
    config.lock()
    return config


def _is_closed_dict(x, name: str = "") -> bool:
    """A schema sub-dict whose keys are fixed (the open ones hold free-form options)."""
    return isinstance(x, ml_collections.ConfigDict) and bool(len(x)) and name not in OPEN_DICTS


def _unknown_fields(config, defaults, prefix=""):
    """Dotted names present in config but not in the defaults (open dicts excepted)."""
    out = []
    for key in config.keys():  # noqa: SIM118 (ConfigDict)
        name = prefix + key
        if key not in defaults:
            out.append(name)
        elif _is_closed_dict(defaults[key], name) and isinstance(
            config[key], ml_collections.ConfigDict
        ):
            out += _unknown_fields(config[key], defaults[key], name + ".")
    return out


def _missing_fields(config, defaults, prefix="") -> list[str]:
    """Dotted names of the defaults absent from config."""
    out = []
    for key in defaults.keys():  # noqa: SIM118 (ConfigDict)
        if key not in config:
            out.append(prefix + key)
        elif _is_closed_dict(defaults[key], prefix + key):
            out += _missing_fields(config[key], defaults[key], f"{prefix}{key}.")
    return out


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> schema.Config:
    """The typed config; ConfigError (one line) on a misspelt field or an impossible value.

    Each field's own check runs as it is parsed (ebpo_jax.schema), then the rules over
    several sections (ebpo_jax.config.checks); with `num_devices`, also the mesh's.
    """
    return validated(config, num_devices)[0]


def validated(
    config: ml_collections.ConfigDict, num_devices: int | None = None
) -> tuple[schema.Config, checks.Derived]:
    """`validate`, with what the checks resolved on the way (the meshes) for the run spec."""
    defaults = default_config()
    unknown = _unknown_fields(config, defaults)
    if unknown:
        raise ConfigError(f"unknown config field(s): {', '.join(unknown)}")
    missing = _missing_fields(config, defaults)
    if missing:
        raise ConfigError(f"missing config field(s): {', '.join(missing)}")
    typed = schema.parse(config)
    return typed, checks.check(typed, num_devices)
