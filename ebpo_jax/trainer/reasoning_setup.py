"""The reasoning task family as a trainer Task (tasks.reasoning's problems, tokenizer, reward).

`reasoning_task(config)` mirrors `task_setup.arithmetic_task`; until task_setup dispatches on
`task.family`, `install(config)` makes `trainer.loop.train` build it for a reasoning config.
"""

import jax
import numpy as np

from ebpo_jax import models, sampler, tasks
from ebpo_jax.tasks import reasoning
from ebpo_jax.trainer import sft
from ebpo_jax.trainer.rollout import batch_rounds, num_clusters
from ebpo_jax.trainer.task_setup import Task, model_config_from


def load_problems(config):
    """(tokenizer, train, test) of the reasoning family from config.task."""
    t = config.task
    topics = tuple(x for x in t.topics.split(",") if x) or reasoning.TOPICS
    levels = tuple(
        d for d in reasoning.DIFFICULTIES if not t.max_difficulty or d <= t.max_difficulty
    )
    train, test = reasoning.make_splits(
        t.seed,
        train_per_cell=t.train_per_cell,
        test_per_cell=t.test_per_cell,
        topics=topics,
        difficulties=levels,
    )
    return reasoning.make_tokenizer(), train, test


def sample_eval(config, model_config, params, problems, tokenizer, mesh=None):
    """(rewards [n, k], lengths [n, k]) of k = eval_samples samples per problem at
    eval_temperature (0 = greedy, k = 1), with the same sampler keys at every call."""
    data = tasks.encode_problems(problems, tokenizer)
    n, bs = len(problems), min(config.eval_batch_size, len(problems))
    pad = (-n) % bs  # repeat the first rows so every chunk has one shape (one compile)
    arrays = [np.concatenate([a, a[:pad]]) for a in data]
    k = config.eval_samples if config.eval_temperature > 0 else 1
    reward = jax.jit(lambda *a: reasoning.reward_fn(*a, eos_id=tokenizer.eos_id))
    rs, ls = [], []
    for i, s in enumerate(range(0, n + pad, bs)):
        chunk = tasks.PromptBatch(*(a[s : s + bs] for a in arrays))
        gen = sampler.generate(
            model_config,
            params,
            chunk.prompt_tokens,
            chunk.prompt_lengths,
            max_new_tokens=config.sampler.max_new_tokens,
            rng=jax.random.fold_in(jax.random.key(config.seed), i),
            temperature=config.eval_temperature,
            eos_id=tokenizer.eos_id,
            num_samples=k,
            mesh=mesh,
        )
        rep = lambda x: np.repeat(x, k, axis=0)
        r = reward(gen.tokens, gen.lengths, rep(chunk.answer_tokens), rep(chunk.answer_lengths))
        rs.append(np.asarray(jax.device_get(r)).reshape(bs, k))
        ls.append(np.asarray(jax.device_get(gen.lengths)).reshape(bs, k))
    return np.concatenate(rs)[:n], np.concatenate(ls)[:n]


def reasoning_task(config, *, mesh=None, log=print) -> Task:
    """task_setup.arithmetic_task with the reasoning family's problems, tokenizer and reward."""
    tokenizer, train_problems, test_problems = load_problems(config)
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

    def evaluate(p) -> float:
        r_nk, _ = sample_eval(config, model_config, p, test_problems, tokenizer, mesh)
        return float(r_nk.mean())

    return Task(
        tokenizer=tokenizer,
        model_config=model_config,
        params=params,
        source=source,
        reward_fn=lambda *a: reasoning.reward_fn(*a, eos_id=eos),
        host_reward=None,
        num_clusters=num_clusters(config),
        stop_ids=eos,
        eos_id=eos,
        evaluate=evaluate,
        close=lambda: None,
    )


def install(config) -> None:
    """Make trainer.loop.train build the reasoning task for `config` (task.family=reasoning).

    A stop-gap until task_setup.build_task dispatches on task.family: it replaces the loop's
    build_task for this process, keeping the original for every other family.
    """
    from ebpo_jax.trainer import loop, task_setup

    if config.task.family != "reasoning":
        return

    def build(c, *, mesh=None, log=print):
        if c.task.family == "reasoning":
            return reasoning_task(c, mesh=mesh, log=log)
        return task_setup.build_task(c, mesh=mesh, log=log)

    loop.build_task = build
