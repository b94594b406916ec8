"""The `data` config section's checks, and the prompt source + host reward it describes.

The section is declared in `ebpo_jax.schema.Data`; then
`source, host_reward = source_from_config(spec.task.data, tokenizer, batch_size, seed=seed)`.
"""

import dataclasses
import os
from collections.abc import Callable

import ml_collections

from ebpo_jax.data.clustering import cluster_texts
from ebpo_jax.data.loading import load_records
from ebpo_jax.data.prompts import TEMPLATES
from ebpo_jax.data.schemas import SCHEMAS, DataError
from ebpo_jax.data.source import MathPromptSource, make_host_reward
from ebpo_jax.data.tokenize import OVERFLOW
from ebpo_jax.order import ORDERS
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
    try:
        get_reward(c.reward)
    except (ValueError, TypeError) as e:
        raise DataError(f"data.reward: {e}") from None
    from ebpo_jax import storage  # data may sit on gs://

    if c.path and not storage.exists(c.path):
        raise DataError(f"data.path={c.path!r}: no such file or folder")
    if c.eval_schema not in SCHEMAS:
        raise DataError(f"data.eval_schema={c.eval_schema!r} unknown; known: {sorted(SCHEMAS)}")
    for _, path in eval_sets(c):
        if not storage.exists(path):
            raise DataError(f"data.eval_path entry {path!r}: no such file or folder")


def source_from_config(
    c: Data,
    tokenizer,
    batch_size: int,
    *,
    seed: int = 0,
    num_hosts: int = 1,
    host_id: int = 0,
    log: Callable[[str], None] = print,
) -> tuple[MathPromptSource, Callable]:
    """(prompt source, host reward) for the data section `c`."""
    validate_data_config(c)
    schema = c.schema if isinstance(c.schema, str) else dict(c.schema)
    records = load_records(c.path, schema, limit=c.limit or None)
    topic_ids = None
    if c.topics == "kmeans":
        topic_ids = cluster_texts([r.prompt for r in records], c.num_clusters, seed=seed)
    elif c.topics == "none":
        records = [dataclasses.replace(r, topic=None) for r in records]
    source = MathPromptSource(
        records,
        tokenizer,
        batch_size,
        c,
        seed=seed,
        topic_ids=topic_ids,
        num_hosts=num_hosts,
        host_id=host_id,
    )
    log(
        f"data: {len(source.records)} prompts from {c.path} ({source.num_dropped} over "
        f"{c.max_prompt_len} tokens dropped), {source.num_clusters} clusters, order {c.order}"
    )
    host_reward = make_host_reward(
        source,
        tokenizer,
        reward=c.reward,
        timeout_s=c.reward_timeout_s,
        workers=c.reward_workers or None,
        format_weight=c.format_weight,
    )
    return source, host_reward
