"""What a run trains on, from its config: tokenizer, initial policy, prompts, reward, EB clusters, eval.

`data.path=""` is the synthetic arithmetic tasks (char tokenizer, jittable exact-answer
reward, optional SFT warm start); otherwise math records from `ebpo_jax.data` with the
checkpoint's tokenizer, scored on the host (math-verify in a process pool).
"""

import json
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from ebpo_jax import distributed, models, policy_eval, rewards, sampler, tasks
from ebpo_jax.config import ConfigError
from ebpo_jax.data import encode_prompts, load_records, load_tokenizer, render_prompt
from ebpo_jax.data.config import eval_sets, source_from_config
from ebpo_jax.models.hf import config_from_hf_dict
from ebpo_jax.trainer import sft
from ebpo_jax.trainer.rollout import batch_rounds, num_clusters

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


class Task(NamedTuple):
    """Everything train() needs to know about the policy and its data."""

    tokenizer: Any
    model_config: models.ModelConfig
    params: Any  # the initial policy (warm-started for the synthetic tasks)
    source: Any  # prompt batches: next_batches(k), state(), restore()
    reward_fn: Callable | None  # jittable (tokens, lengths, answers, answer_lengths) -> [B]
    host_reward: Callable | None  # host (rollout) -> rewards [P, G], when reward_fn is None
    num_clusters: int  # EB priors
    stop_ids: int | list[int]  # the sampler stops on any of these
    eos_id: int | tuple[int, ...]  # ids that end a response (the update's truncation check)
    evaluate: Callable[[Any], float] | None  # params -> held-out pass@1; None = no eval
    close: Callable[[], None]  # stops reward worker processes


def load_tasks(config):
    """(tokenizer, train problems, held-out problems) for the synthetic arithmetic tasks."""
    t = config.task
    topics = tuple(x for x in t.topics.split(",") if x) or tasks.TOPICS
    levels = tuple(d for d in tasks.DIFFICULTIES if not t.max_difficulty or d <= t.max_difficulty)
    train, test = tasks.make_splits(
        t.seed,
        train_per_cell=t.train_per_cell,
        test_per_cell=t.test_per_cell,
        topics=topics,
        difficulties=levels,
    )
    return tasks.CharTokenizer(), train, test


def model_config_from(config, tokenizer):
    """The policy's ModelConfig: the preset, the tokenizer's vocabulary, then overrides."""
    # An HF tokenizer's vocab_size leaves out added tokens (chat markers); len() counts them.
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    return models.get_config(config.model.preset, **{"vocab_size": vocab, **config.model.overrides})


def make_evaluator(config, model_config, problems, tokenizer, mesh=None):
    """evaluate(params) -> held-out pass@1: the mean exact-answer reward over
    `eval_samples` samples per problem at `eval_temperature` (0 = greedy, one sample)."""
    data = tasks.encode_problems(problems, tokenizer)
    n, bs = len(problems), min(config.eval_batch_size, len(problems))
    pad = (-n) % bs  # repeat the first rows so every chunk has one shape (one compile)
    arrays = [np.concatenate([a, a[:pad]]) for a in data]
    temperature = config.eval_temperature
    k = config.eval_samples if temperature > 0 else 1
    reward = jax.jit(lambda *a: tasks.reward_fn(*a, eos_id=tokenizer.eos_id))

    def evaluate(params) -> float:
        total = []
        for i, s in enumerate(range(0, n + pad, bs)):
            chunk = tasks.PromptBatch(*(a[s : s + bs] for a in arrays))
            gen = sampler.generate(
                model_config,
                params,
                chunk.prompt_tokens,
                chunk.prompt_lengths,
                max_new_tokens=config.sampler.max_new_tokens,
                rng=jax.random.fold_in(jax.random.key(config.seed), i),  # same draws every eval
                temperature=temperature,
                eos_id=tokenizer.eos_id,
                num_samples=k,
                mesh=mesh,
            )
            rep = lambda x: np.repeat(x, k, axis=0)
            r = reward(gen.tokens, gen.lengths, rep(chunk.answer_tokens), rep(chunk.answer_lengths))
            total.append(np.asarray(distributed.to_host(r)).reshape(bs, k))
        return float(np.concatenate(total)[:n].mean())

    return evaluate


def arithmetic_task(config, *, mesh=None, log=print) -> Task:
    """The synthetic tasks: char tokenizer, preset init (+ SFT warm start), exact-answer reward."""
    tokenizer, train_problems, test_problems = load_tasks(config)
    model_config = model_config_from(config, tokenizer)
    params = models.init_params(model_config, jax.random.key(config.seed))
    params = sft.warm_start(config, model_config, params, train_problems, tokenizer, log=log)
    source = tasks.PromptSource(
        train_problems,
        tokenizer,
        batch_rounds(config) * config.prompts_per_step,
        seed=config.seed,
        order=config.task.order,
    )
    eos = tokenizer.eos_id
    return Task(
        tokenizer=tokenizer,
        model_config=model_config,
        params=params,
        source=source,
        reward_fn=lambda *a: tasks.reward_fn(*a, eos_id=eos),
        host_reward=None,
        num_clusters=num_clusters(config),
        stop_ids=eos,
        eos_id=eos,
        evaluate=make_evaluator(config, model_config, test_problems, tokenizer, mesh),
        close=lambda: None,
    )


def _hf_model_config(config):
    """The checkpoint's ModelConfig with the config's non-architecture overrides applied."""
    path = os.path.join(config.model.hf_path, "config.json")
    with open(path) as f:
        ckpt = config_from_hf_dict(json.load(f), source=path)
    overrides = dict(config.model.overrides)
    for name, value in overrides.items():
        if name in _ARCHITECTURE and value != getattr(ckpt, name):
            raise ConfigError(
                f"model.overrides.{name}={value!r} differs from the checkpoint's "
                f"{getattr(ckpt, name)!r} (model.hf_path={config.model.hf_path!r})"
            )
    try:
        return ckpt.replace(**overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model.overrides: {e}") from None


def _eval_records(config, tokenizer, log) -> list[tuple[str, list]]:
    """(name, records) of each data.eval_path entry, prompts over data.max_prompt_len dropped."""
    d = config.data
    out = []
    for schema, path in eval_sets(d):
        records = load_records(path, schema, limit=d.eval_limit or None)
        texts = [
            render_prompt(tokenizer, r.prompt, template=d.template, chat=d.chat) for r in records
        ]
        enc = encode_prompts(
            tokenizer, texts, max_length=d.max_prompt_len, on_overflow=d.on_overflow
        )
        name = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        out.append((name, [records[i] for i in enc.kept]))
        log(f"eval: {len(enc.kept)} problems from {path} ({enc.num_dropped} too long dropped)")
    return out


def make_math_evaluator(config, model_config, tokenizer, eval_sets, mesh=None):
    """evaluate(params) -> pass@1 averaged over the eval sets: each the mean of data.reward
    over `eval_samples` samples per problem at `eval_temperature` (0 = greedy, one sample)."""
    d = config.data
    temperature = config.eval_temperature
    k = config.eval_samples if temperature > 0 else 1

    def evaluate(params) -> float:
        per_set = []
        for _, records in eval_sets:
            responses = policy_eval.sample_responses(
                model_config,
                params,
                tokenizer,
                records,
                num_samples=k,
                max_new_tokens=config.sampler.max_new_tokens,
                max_prompt_len=d.max_prompt_len,
                batch_size=config.eval_batch_size,
                template=d.template,
                chat=d.chat,
                temperature=temperature,
                seed=config.seed,  # same draws every eval
                mesh=mesh,
            )
            correct_PK, _, _ = policy_eval.score_responses(
                records,
                responses,
                reward=d.reward,
                timeout_s=d.reward_timeout_s,
                workers=d.reward_workers or None,
            )
            per_set.append(correct_PK.mean())
        return float(np.mean(per_set))

    return evaluate


def _close_reward_pools() -> None:
    # The host reward and the eval score in rewards' shared pools, which restart on next use.
    rewards.close_pools()


def math_task(config, *, mesh=None, log=print) -> Task:
    """Math records (data.*), an HF tokenizer, and the HF checkpoint or a random preset."""
    m, d = config.model, config.data
    tokenizer = load_tokenizer(m.hf_path or m.tokenizer_path)
    model_config = _hf_model_config(config) if m.hf_path else model_config_from(config, tokenizer)
    need_pos = d.max_prompt_len + config.sampler.max_new_tokens
    if need_pos > model_config.max_position_embeddings:
        raise ConfigError(
            f"data.max_prompt_len + sampler.max_new_tokens = {need_pos} exceeds the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )
    if model_config.attention == "splash":
        from ebpo_jax.models import splash  # Pallas TPU import, only when asked for

        # The sampler's prefill runs the kernel over the prompt width, the update over rows.
        for name, width in (
            ("data.max_prompt_len", d.max_prompt_len),
            ("data.max_prompt_len + sampler.max_new_tokens", need_pos),
        ):
            if width > splash.BLOCK and width % splash.BLOCK:
                raise ConfigError(
                    f"{name} = {width}: attention 'splash' needs at most {splash.BLOCK} "
                    f"tokens or a multiple of {splash.BLOCK}"
                )
    if len(tokenizer) > model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer of {m.hf_path or m.tokenizer_path!r} has {len(tokenizer)} tokens, "
            f"more than the model's vocab_size={model_config.vocab_size}"
        )
    # Data before weights: a bad file fails in seconds, not after loading a checkpoint.
    source, host_reward = source_from_config(
        d, tokenizer, batch_rounds(config) * config.prompts_per_step, seed=config.seed, log=log
    )
    evals = _eval_records(config, tokenizer, log)
    if m.hf_path:
        _, params = models.from_hf(m.hf_path, dtype=model_config.param_dtype)
    else:
        params = models.init_params(model_config, jax.random.key(config.seed))
    evaluate = make_math_evaluator(config, model_config, tokenizer, evals, mesh) if evals else None
    return Task(
        tokenizer=tokenizer,
        model_config=model_config,
        params=params,
        source=source,
        reward_fn=None,
        host_reward=host_reward,
        num_clusters=num_clusters(config, topic_count=source.num_clusters),
        stop_ids=policy_eval.stop_ids(tokenizer),
        eos_id=tuple(policy_eval.stop_ids(tokenizer)),
        evaluate=evaluate,
        close=_close_reward_pools,
    )


def build_task(config, *, mesh=None, log=print) -> Task:
    """The Task `config` describes: math data when data.path is set, else the synthetic tasks."""
    return (math_task if config.data.path else arithmetic_task)(config, mesh=mesh, log=log)
