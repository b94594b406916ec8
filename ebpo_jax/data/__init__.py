"""Math datasets: schemas, loading, prompt templates, tokenisation, clustering and record orders."""

from ebpo_jax.data.clustering import cluster_texts, embed_texts, kmeans, topic_ids_from_field
from ebpo_jax.data.loading import load_records, save_records
from ebpo_jax.data.order import ORDERS, RecordOrder
from ebpo_jax.data.prompts import TEMPLATES, format_prompt, render_prompt
from ebpo_jax.data.schemas import SCHEMAS, DataError, Record, Schema, get_schema, to_record
from ebpo_jax.data.tokenize import (
    EncodedPrompts,
    decode_completions,
    encode_prompts,
    load_tokenizer,
)

__all__ = [
    "ORDERS",
    "SCHEMAS",
    "TEMPLATES",
    "DataError",
    "EncodedPrompts",
    "Record",
    "RecordOrder",
    "Schema",
    "cluster_texts",
    "decode_completions",
    "embed_texts",
    "encode_prompts",
    "format_prompt",
    "get_schema",
    "kmeans",
    "load_records",
    "load_tokenizer",
    "render_prompt",
    "save_records",
    "to_record",
    "topic_ids_from_field",
]
