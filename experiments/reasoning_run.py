"""Measure the reasoning family's warm start: held-out pass@1 per cell, the expected share of
all-fail groups at G = 2, 4, 8, and the sampled response lengths.

  python experiments/reasoning_run.py --config=configs/reasoning.py

(Training on it is `python experiments/train.py --config=configs/reasoning.py`.)
"""

import json
import time

import numpy as np

from ebpo_jax import cli, sampler, tasks
from ebpo_jax.evaluation import policy as policy_eval
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.families import reasoning as task_reasoning

_CONFIG = cli.define_config("config", "configs/reasoning.py", "Training config.")


def warm_stats(config) -> dict:
    """Held-out pass@1, all-fail share per group size and sampled lengths after the warm start."""
    spec = resolve(config)
    t0 = time.time()
    task = task_reasoning.build(spec.task)
    t1 = time.time()
    _, _, test = task_reasoning.load_problems(spec.task)
    k = spec.eval.samples_per_problem
    data = tasks.encode_problems(test, task.tokenizer)
    tokens, lengths = policy_eval.sample_chunks(
        task.model_config,
        task.params,
        data.prompt_tokens,
        data.prompt_lengths,
        sampler.SamplerSpec(
            max_new_tokens=spec.eval.max_new_tokens,
            num_samples=k,
            eos_ids=task.tokenizer.eos_id,
            sampling=sampler.Sampling(spec.eval.run.eval_temperature),
        ),
        policy_eval.Chunks(spec.eval.run.eval_batch_size, spec.run.seed),
    )
    rep = lambda x: np.repeat(x, k, axis=0)
    r = task.reward.fn(tokens, lengths, rep(data.answer_tokens), rep(data.answer_lengths))
    r_nk, len_nk = np.asarray(r).reshape(-1, k), lengths.reshape(-1, k)
    out = {"sft_s": t1 - t0, "eval_s": time.time() - t1, "pass@1": float(r_nk.mean())}
    p_n = r_nk.mean(1)
    for g in (2, 4, 8):  # P(all G fail) under each problem's estimated pass rate
        out[f"all_fail_G{g}"] = float(np.mean((1 - p_n) ** g))
    cells = {}
    for prob, p in zip(test, p_n):
        cells.setdefault(f"{prob.topic}/{prob.difficulty}", []).append(p)
    out["cells"] = {c: float(np.mean(v)) for c, v in cells.items()}
    flat = len_nk.ravel()
    out["sampled_length_pcts"] = np.percentile(flat, [0, 10, 25, 50, 75, 90, 99, 100]).tolist()
    out["sampled_length_mean"] = float(flat.mean())
    out["truncated_frac"] = float((flat >= spec.eval.max_new_tokens).mean())
    return out


def main(argv):
    del argv
    print(json.dumps(warm_stats(_CONFIG.value), indent=1))


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
