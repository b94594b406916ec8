"""The `data` config section's defaults and checks (the section is declared in `ebpo_jax.schema.Data`)."""

import dataclasses

import ml_collections

from ebpo_jax.data.order import ORDERS
from ebpo_jax.data.prompts import TEMPLATES
from ebpo_jax.data.schemas import SCHEMAS, DataError
from ebpo_jax.data.tokenize import OVERFLOW
from ebpo_jax.rewards import get_reward
from ebpo_jax.schema import Data

TOPIC_SOURCES = ("field", "kmeans", "none")


def data_config() -> ml_collections.ConfigDict:
    """The `data` section of the training config as a ConfigDict, with its defaults."""
    return ml_collections.ConfigDict(dataclasses.asdict(Data()))


def eval_sets(c: Data) -> list[tuple[str, str]]:
    """(schema, path) of each entry of `c.eval_path` ("path" or "schema:path")."""
    out = []
    for entry in (e.strip() for e in c.eval_path.split(",")):
        if not entry:
            continue
        schema, sep, path = entry.partition(":")
        if not sep or schema not in SCHEMAS:
            schema, path = c.eval_schema, entry
        out.append((schema, path))
    return out


def validate_data_config(c) -> None:
    """Raise DataError (one line) on an impossible value, before anything is loaded."""
    if isinstance(c.schema, str) and c.schema not in SCHEMAS:
        raise DataError(f"data.schema={c.schema!r} unknown; known: {sorted(SCHEMAS)} or a mapping")
    if c.order not in ORDERS:
        raise DataError(f"data.order={c.order!r} unknown; known: {ORDERS}")
    if c.topics not in TOPIC_SOURCES:
        raise DataError(f"data.topics={c.topics!r} unknown; known: {TOPIC_SOURCES}")
    if c.order == "topic" and c.topics == "none":
        raise DataError("data.order='topic' needs data.topics='field' or 'kmeans'")
    if c.on_overflow not in OVERFLOW:
        raise DataError(f"data.on_overflow={c.on_overflow!r} unknown; known: {OVERFLOW}")
    if "{problem}" not in c.template and c.template not in TEMPLATES:
        raise DataError(
            f"data.template={c.template!r}: a name in {sorted(TEMPLATES)} or has {{problem}}"
        )
    from ebpo_jax.runtime import storage  # data may sit on gs://

    if c.path and not storage.exists(c.path):
        raise DataError(f"data.path={c.path!r}: no such file or folder")
    if c.eval_schema not in SCHEMAS:
        raise DataError(f"data.eval_schema={c.eval_schema!r} unknown; known: {sorted(SCHEMAS)}")
    for _, path in eval_sets(c):
        if not storage.exists(path):
            raise DataError(f"data.eval_path entry {path!r}: no such file or folder")
    try:
        get_reward(c.reward)
    except (ValueError, TypeError) as e:
        raise DataError(f"data.reward: {e}") from None
