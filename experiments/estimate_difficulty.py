"""Write each problem's difficulty as 1 - the base policy's pass rate over n samples (EBPO-diff).

python experiments/estimate_difficulty.py --model=/ckpt/Qwen3-8B \
  --data=/data/dapo.parquet --schema=dapo --n=16 --out=/data/dapo_difficulty.jsonl
The output holds the records (prompt, answer, id, topic, difficulty) plus a pass_rate
column; train on it with schema "record" and order "difficulty".

Toy mode, on a generated task (arithmetic, reasoning) and its own warm start:
python experiments/estimate_difficulty.py --config=configs/reasoning.py --config.sft.seed=300 \
  [--config.sft.params_file=results/.../warm_starts/<sha256>.npz] --n=16 --out=difficulty.jsonl
samples every training and held-out problem n times at temperature 1 (the warm start: the
committed params file, or the SFT run the config names, cached) and writes the difficulty
file of ebpo_jax/tasks/difficulty.py; train on it with `--config.task.difficulty_file=` and
`--config.task.order=difficulty` (or reverse_difficulty). A grid's `task.difficulty_file=auto`
writes the same file beside the warm start.
"""

import sys
import time

from absl import flags

from ebpo_jax import cli

_MODEL = flags.DEFINE_string("model", None, "Local HF checkpoint folder (the base policy).")
_CKPT = flags.DEFINE_string("checkpoint", None, "Trainer workdir: use its latest params instead.")
_DATA = flags.DEFINE_string("data", None, "Dataset file or folder.")
_SCHEMA = flags.DEFINE_string("schema", "record", "Schema name (ebpo_jax.data.SCHEMAS).")
_OUT = flags.DEFINE_string("out", None, "Output .jsonl path.")
_N = flags.DEFINE_integer("n", 16, "Samples per problem (paper: 16 at temperature 1).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 1024, "Response token budget.")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_len", 1024, "Prompt token budget (longer: error).")
_TEMP = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TEMPLATE = flags.DEFINE_string("template", "answer", "Prompt template: answer | boxed | plain.")
_CHAT = flags.DEFINE_bool("chat", True, "Wrap prompts in the tokenizer's chat template.")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Prompts per generate call.")
_REWARD = flags.DEFINE_string("reward", "math", "Reward name or pkg.module:fn.")
_LIMIT = flags.DEFINE_integer("limit", None, "Only the first N problems.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_CONFIG = cli.define_config("config", None, "Toy mode: a generated task's training config.")
_RECORD_FLAGS = ("model", "checkpoint", "data", "schema", "template", "chat", "reward")


def run() -> list[float]:
    """Estimate and write the difficulties; returns the pass rates."""
    import dataclasses

    from ebpo_jax.data import load_records, save_records
    from ebpo_jax.evaluation import policy as policy_eval

    model_config, params, tokenizer = policy_eval.load_policy(_MODEL.value, checkpoint=_CKPT.value)
    records = load_records(_DATA.value, _SCHEMA.value, limit=_LIMIT.value)
    t0 = time.time()
    responses = policy_eval.sample_responses(
        model_config,
        params,
        tokenizer,
        records,
        policy_eval.ResponseSpec(
            num_samples=_N.value,
            max_new_tokens=_MAX_NEW.value,
            max_prompt_len=_MAX_PROMPT.value,
            batch_size=_BATCH.value,
            template=_TEMPLATE.value,
            chat=_CHAT.value,
            temperature=_TEMP.value,
            seed=_SEED.value,
        ),
    )
    correct, _, _ = policy_eval.score_responses(
        records, responses, policy_eval.Scoring(reward=_REWARD.value)
    )
    rates = correct.mean(1).tolist()
    out = [dataclasses.replace(r, difficulty=1.0 - p) for r, p in zip(records, rates)]
    save_records(out, _OUT.value, pass_rate=rates)
    print(
        f"{len(records)} problems x {_N.value} samples in {time.time() - t0:.0f} s; "
        f"mean pass rate {sum(rates) / len(rates):.3f}; wrote {_OUT.value}"
    )
    return rates


def run_toy(config, out: str, n: int, seed: int = 0) -> list[dict]:
    """The toy task's difficulty file at `out`: the warm start's correct count over n samples
    at temperature 1 of every training and held-out problem; returns its rows."""
    import jax

    from ebpo_jax import spec as spec_lib
    from ebpo_jax.tasks import difficulty
    from ebpo_jax.tasks.families import arithmetic as generated

    config = config.copy_and_resolve_references()
    config.task.difficulty_file, config.task.difficulty_samples = "", n
    spec = spec_lib.resolve(config, jax.device_count()).task
    fam = generated.generated(spec.family)
    _, train, test = generated.load_problems(spec, fam.module, fam.tokenizer)
    warm = generated.warm_start(spec, fam, train)
    t0 = time.time()
    problems = {difficulty.TRAIN: train, difficulty.HELDOUT: test}
    rows = generated.estimate_difficulty(spec, fam, warm, problems, seed=seed)
    difficulty.write(out, rows)
    rate = sum(r["pass_rate"] for r in rows) / len(rows)
    print(
        f"{len(rows)} problems x {n} samples in {time.time() - t0:.0f} s from warm start "
        f"{warm.digest[:12]}; mean pass rate {rate:.3f}; wrote {out}"
    )
    return rows


def main(argv):
    del argv
    if _CONFIG.value is None:
        missing = [f"--{n}" for n in ("model", "data", "out") if flags.FLAGS[n].value is None]
        if missing:
            sys.exit(f"give {', '.join(missing)} (or --config=<toy task config> and --out)")
        run()
        return
    given = [f"--{n}" for n in _RECORD_FLAGS if flags.FLAGS[n].present]
    if _OUT.value is None:
        sys.exit("toy mode (--config): give --out")
    if given:
        sys.exit(f"toy mode (--config): {given[0]} is for the --model/--data mode")
    if _TEMP.value != 1.0:
        sys.exit("toy mode (--config): the difficulty is the pass rate at --temperature=1")
    run_toy(_CONFIG.value, _OUT.value, _N.value, _SEED.value)


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
