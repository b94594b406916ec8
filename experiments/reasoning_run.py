"""Train on the reasoning task family before `task.family` is wired into task_setup.

`python experiments/reasoning_run.py --config=configs/reasoning.py [--warm_only]` builds the
task the way `task_setup.arithmetic_task` does, with `ebpo_jax.tasks.reasoning`'s problems,
tokenizer and reward, and trains with `trainer.loop.train` (its `build_task` patched).
`--warm_only` stops after the SFT warm start and prints the held-out pass@1, the share of
all-fail groups and the sampled response lengths. Delete once task_setup knows the family.
"""

import json
import time

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from ebpo_jax import models, sampler, tasks
from ebpo_jax.tasks import reasoning
from ebpo_jax.trainer import loop, sft
from ebpo_jax.trainer.rollout import batch_rounds, num_clusters
from ebpo_jax.trainer.task_setup import Task, model_config_from

_CONFIG = config_flags.DEFINE_config_file("config", "configs/reasoning.py", "Training config.")
_WARM_ONLY = flags.DEFINE_bool("warm_only", False, "Only the warm start and its statistics.")


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
    """(rewards [n, k], lengths [n, k]) of k = eval_samples samples per held-out problem."""
    data = tasks.encode_problems(problems, tokenizer)
    n, bs = len(problems), min(config.eval_batch_size, len(problems))
    pad = (-n) % bs
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
        rs.append(np.asarray(r).reshape(bs, k))
        ls.append(np.asarray(gen.lengths).reshape(bs, k))
    return np.concatenate(rs)[:n], np.concatenate(ls)[:n]


def reasoning_task(config, *, mesh=None, log=print) -> Task:
    """task_setup.arithmetic_task with the reasoning family's pieces."""
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
        return float(sample_eval(config, model_config, p, test_problems, tokenizer, mesh)[0].mean())

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


def warm_stats(config) -> dict:
    """Held-out pass@1, all-fail share per group size and sampled lengths after the warm start."""
    t0 = time.time()
    task = reasoning_task(config)
    t1 = time.time()
    _, _, test = load_problems(config)
    r_nk, len_nk = sample_eval(config, task.model_config, task.params, test, task.tokenizer)
    out = {"sft_s": t1 - t0, "eval_s": time.time() - t1, "pass@1": float(r_nk.mean())}
    p_n = r_nk.mean(1)
    for g in (2, 4, 8):  # P(all G fail) under each problem's estimated pass rate
        out[f"all_fail_G{g}"] = float(np.mean((1 - p_n) ** g))
    cells = {}
    for prob, p in zip(test, p_n):
        cells.setdefault(f"{prob.topic}/{prob.difficulty}", []).append(p)
    out["cells"] = {c: float(np.mean(v)) for c, v in cells.items()}
    lengths = len_nk.ravel()
    out["sampled_length_pcts"] = np.percentile(lengths, [0, 10, 25, 50, 75, 90, 99, 100]).tolist()
    out["sampled_length_mean"] = float(lengths.mean())
    out["truncated_frac"] = float((lengths >= config.sampler.max_new_tokens).mean())
    return out


def main(argv):
    del argv
    config = _CONFIG.value
    if _WARM_ONLY.value:
        print(json.dumps(warm_stats(config), indent=1))
        return
    loop.build_task = lambda c, mesh=None, log=print: reasoning_task(c, mesh=mesh, log=log)
    summary = loop.train(config)
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    app.run(main)
