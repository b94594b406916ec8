"""Train on the reasoning task family, or measure its warm start.

`python experiments/reasoning_run.py --config=configs/reasoning.py [--warm_only]` trains with
`trainer.loop.train` on `trainer.reasoning_setup.reasoning_task` (installed until task_setup
dispatches on task.family). `--warm_only` stops after the SFT warm start and prints the
held-out pass@1 per cell, the expected share of all-fail groups at G = 2, 4, 8 and the
sampled response lengths.
"""

import json
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from ebpo_jax.trainer import loop
from ebpo_jax.trainer.reasoning_setup import install, load_problems, reasoning_task, sample_eval

_CONFIG = config_flags.DEFINE_config_file("config", "configs/reasoning.py", "Training config.")
_WARM_ONLY = flags.DEFINE_bool("warm_only", False, "Only the warm start and its statistics.")


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
    install(config)
    summary = loop.train(config)
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    app.run(main)
