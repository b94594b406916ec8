"""Evaluate a policy: mean@k and pass@k (and maj@k on math) with bootstrap 95% intervals.

A training run, on its own task's held-out sets (any task family: arithmetic, reasoning, math):
python experiments/eval.py --workdir=runs/tiny [--step=200] [--k=16]
  (the latest checkpoint, or --step's; k defaults to the run's eval_samples; writes
  <workdir>/eval_step<N>.json)
A model on math benchmarks:
python experiments/eval.py --model=/ckpt/Qwen3-8B [--checkpoint=/runs/x] \
  --benchmarks=math500:math500:/data/math500.jsonl,aime24:aime2024:/data/aime24.parquet \
  --k=16 --max_new_tokens=8192 --out=/runs/x/eval.json
Each benchmark is name:schema:path (schemas: ebpo_jax.data.SCHEMAS). Prints a table and
writes {benchmark: {metric: {value, lo, hi}}} (fractions, not percent) as JSON.
"""

import json
import os
import time

from absl import app, flags

from ebpo_jax import cli

_MODEL = flags.DEFINE_string(
    "model", None, "Local HF checkpoint folder (config, weights, tokenizer)."
)
_CKPT = flags.DEFINE_string("checkpoint", None, "Trainer workdir: use its latest params instead.")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "A training run's folder: evaluate it on its own task's held-out sets."
)
_STEP = flags.DEFINE_integer(
    "step", None, "With --workdir: this checkpoint step (default: latest)."
)
_BENCH = flags.DEFINE_list("benchmarks", None, "name:schema:path, comma-separated.")
_K = flags.DEFINE_integer("k", 16, "Samples per problem (paper: 16; 4 for OlympiadBench).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 1024, "Response token budget.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", 1024, "Prompt token budget (longer: error).")
_TEMP = flags.DEFINE_float("temperature", 1.0, "Sampling temperature (paper: 1.0).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass.")
_TEMPLATE = flags.DEFINE_string("template", "answer", "Prompt template: answer | boxed | plain.")
_CHAT = flags.DEFINE_bool("chat", True, "Wrap prompts in the tokenizer's chat template.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Prompts per generate call.")
_REWARD = flags.DEFINE_string("reward", "math", "Reward name or pkg.module:fn.")
_WORKERS = flags.DEFINE_integer("workers", None, "Reward worker processes.")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N problems of each benchmark.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_OUT = flags.DEFINE_string(
    "out", None, "JSON output path (default: <checkpoint or model>/eval.json)."
)


def run(argv=None) -> dict:
    """Evaluate every benchmark as the flags say; returns the results written to --out."""
    from ebpo_jax import evaluation
    from ebpo_jax.data import load_records
    from ebpo_jax.evaluation import policy as policy_eval

    if _WORKDIR.value:
        from ebpo_jax.trainer import run_eval

        k = _K.value if flags.FLAGS["k"].present else None
        results, out = run_eval.evaluate_run(_WORKDIR.value, step=_STEP.value, k=k, out=_OUT.value)
        print(evaluation.format_table(results))
        print(f"wrote {out}")
        return results
    if not (_MODEL.value and _BENCH.value):
        raise app.UsageError("give --workdir=RUN, or --model and --benchmarks")

    # Every path and benchmark file is checked before the model loads (and nothing is created).
    policy_eval.check_policy_paths(_MODEL.value, _CKPT.value)
    benchmarks = []
    for spec in _BENCH.value:
        parts = spec.split(":", 2)
        if len(parts) != 3:
            raise app.UsageError(f"benchmark {spec!r} is not name:schema:path")
        name, schema, path = parts
        benchmarks.append((name, load_records(path, schema, limit=_LIMIT.value)))
    out = _OUT.value or os.path.join(_CKPT.value or _MODEL.value, "eval.json")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        raise FileNotFoundError(f"--out={out}: folder {os.path.dirname(out)} does not exist")
    model_config, params, tokenizer = policy_eval.load_policy(_MODEL.value, checkpoint=_CKPT.value)
    results = {}
    for name, records in benchmarks:
        t0 = time.time()
        responses = policy_eval.sample_responses(
            model_config,
            params,
            tokenizer,
            records,
            policy_eval.ResponseSpec(
                num_samples=_K.value,
                max_new_tokens=_MAX_NEW.value,
                max_prompt_len=_MAX_PROMPT.value,
                batch_size=_BATCH.value,
                template=_TEMPLATE.value,
                chat=_CHAT.value,
                temperature=_TEMP.value,
                top_p=_TOP_P.value,
                seed=_SEED.value,
            ),
        )
        scoring = policy_eval.Scoring(reward=_REWARD.value, workers=_WORKERS.value)
        results[name] = policy_eval.evaluate_benchmark(records, responses, scoring=scoring)
        print(f"{name}: {len(records)} problems x {_K.value} samples in {time.time() - t0:.0f} s")
    print(evaluation.format_table(results))
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out}")
    return results


def main(argv):
    del argv
    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every restore at INFO
    run()


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
