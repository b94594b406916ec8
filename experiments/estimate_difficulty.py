"""Write each problem's difficulty as 1 - the base policy's pass rate over n samples (EBPO-diff).

python experiments/estimate_difficulty.py --model=/ckpt/Qwen3-8B \
  --data=/data/dapo.parquet --schema=dapo --n=16 --out=/data/dapo_difficulty.jsonl
The output holds the records (prompt, answer, id, topic, difficulty) plus a pass_rate
column; train on it with schema "record" and order "difficulty".
"""

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


def main(argv):
    del argv
    run()


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    flags.mark_flags_as_required(["model", "data", "out"])
    cli.run(main)
