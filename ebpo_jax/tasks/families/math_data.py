"""The math-records family: `data.*` records, the checkpoint's (or a local) HF tokenizer, an HF
checkpoint or a random preset, and math-verify on the host (a process pool)."""

import json
import os

import jax
import jax.numpy as jnp

from ebpo_jax import models, rewards
from ebpo_jax.data import (
    decode_completions,
    encode_prompts,
    load_records,
    load_tokenizer,
    render_prompt,
)
from ebpo_jax.data.config import eval_sets
from ebpo_jax.evaluation import policy as policy_eval
from ebpo_jax.evaluation.evaluator import EvalSet, make_evaluator
from ebpo_jax.models.hf import config_from_hf_dict
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import TaskSpec
from ebpo_jax.tasks.math_source import source_from_config
from ebpo_jax.tasks.protocol import Reward, Task, model_config_from

# Fields that fix the parameter shapes (or their meaning): a checkpoint's values win.
_ARCHITECTURE = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "tie_word_embeddings",
    "qk_norm",
    "model_type",
)


def hf_model_config(model_spec) -> models.ModelConfig:
    """The checkpoint's ModelConfig with the config's non-architecture overrides applied."""
    path = os.path.join(model_spec.hf_path, "config.json")
    with open(path) as f:
        ckpt = config_from_hf_dict(json.load(f), source=path)
    overrides = model_spec.overrides.to_dict()
    for name, value in overrides.items():
        if name in _ARCHITECTURE and value != getattr(ckpt, name):
            raise ConfigError(
                f"model.overrides.{name}={value!r} differs from the checkpoint's "
                f"{getattr(ckpt, name)!r} (model.hf_path={model_spec.hf_path!r})"
            )
    try:
        return ckpt.replace(**{"batch_invariant": model_spec.batch_invariant, **overrides})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.overrides: {e}") from None


def check_model(spec: TaskSpec, model_config, tokenizer) -> None:
    """Positions and vocabulary against the data: ConfigError if not (splash block widths:
    config.checks)."""
    d, m = spec.data, spec.model
    need_pos = d.max_prompt_len + spec.max_new_tokens
    if need_pos > model_config.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_len + sampler.max_new_tokens = {need_pos} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer of {m.hf_path or m.tokenizer_path!r} has {len(tokenizer)} tokens, "
            f"more than the model's vocab_size={model_config.vocab_size}"
        )


def eval_record_sets(spec: TaskSpec, tokenizer, log) -> list[EvalSet]:
    """One EvalSet per data.eval_path entry; prompts over data.max_prompt_len dropped."""
    d = spec.data
    out = []
    for schema, path in eval_sets(d):
        records = load_records(path, schema, limit=d.eval_limit or None)
        texts = [
            render_prompt(tokenizer, r.prompt, template=d.template, chat=d.chat) for r in records
        ]
        enc = encode_prompts(
            tokenizer, texts, max_length=d.max_prompt_len, on_overflow=d.on_overflow
        )
        kept = [records[i] for i in enc.kept]
        name = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        log(f"eval: {len(kept)} problems from {path} ({enc.num_dropped} too long dropped)")
        out.append(_record_set(spec, name, kept, enc, tokenizer))
    return out


def _record_set(spec: TaskSpec, name, records, enc, tokenizer) -> EvalSet:
    d = spec.data

    def score(tokens, lengths):
        k = len(lengths) // len(records)
        texts = decode_completions(tokenizer, tokens, lengths)
        answers = [r.answer for r in records for _ in range(k)]
        r_B = rewards.math_rewards(
            texts,
            answers,
            timeout_s=d.reward_timeout_s,
            workers=d.reward_workers or None,
            reward=d.reward,
        )
        return r_B > 0.5

    stride = min(
        spec.eval.run.eval_batch_size, len(records)
    )  # chunk i folds in its first row's index
    return EvalSet(name, enc.tokens, enc.lengths, score, key_stride=stride)


def cluster_ids(eb_clusters: str, batch) -> jax.Array:
    """[P] int32: the record's topic (data.topics) with eb_clusters='topic', else 0."""
    topic = jnp.asarray(batch.topic_ids, jnp.int32)
    return topic if eb_clusters == "topic" else jnp.zeros_like(topic)


def build(spec: TaskSpec, *, mesh=None, log=print) -> Task:
    """Math records (data.*), an HF tokenizer, and the HF checkpoint or a random preset."""
    m, d = spec.model, spec.data
    tokenizer = load_tokenizer(m.hf_path or m.tokenizer_path)
    if m.hf_path:
        model_config = hf_model_config(m)
    else:
        model_config = model_config_from(m, len(tokenizer))
    check_model(spec, model_config, tokenizer)
    # Data before weights: a bad file fails in seconds, not after loading a checkpoint.
    source, host_reward = source_from_config(
        d, tokenizer, spec.batch_prompts, seed=spec.run.seed, log=log
    )
    sets = eval_record_sets(spec, tokenizer, log)
    if m.hf_path:
        _, params = models.from_hf(m.hf_path, dtype=model_config.param_dtype)
    else:
        params = models.init_params(model_config, jax.random.key(spec.run.seed))
    stops = tuple(policy_eval.stop_ids(tokenizer))
    clusters = source.num_clusters if spec.run.eb_clusters == "topic" else 1
    return Task(
        tokenizer=tokenizer,
        model_config=model_config,
        params=params,
        source=source,
        reward=Reward(host_reward, jittable=False),
        cluster_ids=lambda batch: cluster_ids(spec.run.eb_clusters, batch),
        num_clusters=clusters,
        stop_ids=stops,
        evaluate=make_evaluator(spec.eval, model_config, sets, stops, mesh),
        close=rewards.close_pools,  # the host reward and the eval score share its pools
        base_source=m.hf_path or f"init(seed={spec.run.seed})",
    )
