"""Refactor guard: train a fixed set of small runs and compare their metrics bitwise.

    python tools/behaviour_check.py --out=/tmp/before --root=<checkout of the old commit>
    python tools/behaviour_check.py --out=/tmp/after --compare=/tmp/before

Each case is `experiments/train.py` with `--config.` overrides in a fresh workdir (subprocess,
so the CLI and its override names are part of what is checked). Metrics are compared with
timing fields (perf/*, anything per second) removed; equal means every remaining value is
bitwise equal, row by row. Results are only comparable on one CPU family.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

MICRO = ["--config=configs/micro.py"]
EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
SHARDED = [
    "--config.prompts_per_step=8",
    "--config.optimizer.learning_rate=3e-3",
    "--config.loss.kl_coef=0.01",
    "--config.loss.num_microbatches=2",
    "--config.model.overrides.num_heads=4",
    "--config.model.overrides.num_kv_heads=2",
    "--config.mesh.shape=(2,2,2)",
    "--config.mesh.axes=('data','fsdp','tp')",
]
STALE = [
    "--config.rollout.max_staleness=1",
    "--config.mesh.devices=4",
    "--config.mesh.shape=(4,)",
    "--config.sampler.mesh=data=4",
    "--config.loss.recompute_old_logprobs=True",
    "--config.loss.is_correction=tis",
]
SLOTS_PACKED = [
    "--config.sampler.slots=8",
    "--config.loss.tokens_per_microbatch=64",
    "--config.total_steps=4",
]
MATH = [
    "--config.total_steps=4",
    "--config.checkpoint_every=2",
    "--config.eval_every=2",
    "--config.prompts_per_step=4",
    "--config.group_size=4",
    "--config.eb_clusters=topic",
    "--config.eval_samples=2",
    "--config.eval_batch_size=4",
    "--config.optimizer.learning_rate=1e-2",
    "--config.sampler.max_new_tokens=6",
    "--config.model.overrides.hidden_size=32",
    "--config.model.overrides.intermediate_size=64",
    "--config.model.overrides.num_layers=1",
    "--config.model.overrides.num_heads=2",
    "--config.model.overrides.num_kv_heads=1",
    "--config.model.overrides.head_dim=16",
    "--config.model.overrides.max_position_embeddings=32",
    "--config.data.schema=math500",
    "--config.data.template=plain",
    "--config.data.max_prompt_len=12",
    "--config.data.order=topic",
    "--config.data.reward=math",
    "--config.data.reward_workers=1",
    "--config.sft.steps=0",
]

# Multi-turn episodes with an environment (workers, observation masks), shortened.
GUESS = ["--config.total_steps=3", "--config.eval_every=3", "--config.checkpoint_every=3"]
GUESS += ["--config.sft.steps=30", "--config.prompts_per_step=8", "--config.task.test_per_cell=4"]

# Warm-started (non-zero gradients at every step): the gradient path, KL, LoRA and staleness.
WARM = [*MICRO, "--config.sft.steps=40", "--config.group_size=8"]
WARM += ["--config.optimizer.learning_rate=1e-2"]
KL = ["--config.loss.kl_coef=0.01"]

CASES = {
    "micro": (MICRO, {}),
    "micro_k2": (MICRO + ["--config.steps_per_jit=2"], {}),
    "sharded_2x2x2_kl_micro": (MICRO + SHARDED, EIGHT),
    "lora_r4": (MICRO + ["--config.model.lora.rank=4"], {}),
    "stale1_recompute_tis": (MICRO + STALE, EIGHT),
    "slots_packed": (MICRO + SLOTS_PACKED, {}),
    "math_records": (["--config=configs/micro.py"] + MATH, {}),
    "tiny_default": ([], {}),
    "warm_kl_micro_entropy_dual": (
        WARM
        + KL
        + ["--config.loss.num_microbatches=2", "--config.loss.entropy_coef=0.01"]
        + ["--config.loss.dual_clip=3"],
        {},
    ),
    "warm_k2_gspo": (
        WARM
        + ["--config.steps_per_jit=2", "--config.loss.name=gspo"]
        + ["--config.loss.agg=seq-mean-token-mean"],
        {},
    ),
    "warm_lora_kl": (
        WARM + KL + ["--config.model.lora.rank=4", "--config.loss.num_microbatches=2"],
        {},
    ),
    "warm_packed_recompute_tis": (
        WARM + KL + SLOTS_PACKED[:2] + STALE[-2:],
        {},
    ),
    "warm_stale1_kl": (WARM + KL + STALE, EIGHT),
    "warm_lora_stale1": (WARM + ["--config.model.lora.rank=4"] + STALE, EIGHT),
    "guess_multiturn": (["--config=configs/guess.py", *GUESS], {}),
    # Turns that prefill the episode so far (the multi-turn path before KV was kept).
    "guess_reprefill": (
        ["--config=configs/guess.py", *GUESS, "--config.rollout.keep_kv=False"],
        {},
    ),
    # The same through 8 decode slots per call (the turn loop dropped sampler.slots before).
    "guess_reprefill_slots": (
        ["--config=configs/guess.py", *GUESS, "--config.rollout.keep_kv=False"]
        + ["--config.sampler.slots=8"],
        {},
    ),
    # A mixture-of-experts policy in the turn loop (routing replay there is now refused).
    "guess_moe": (
        ["--config=configs/guess.py", *GUESS, "--config.model.preset=tiny_moe"]
        + ["--config.model.overrides.scan_unroll=1"],
        {},
    ),
    # The same with routing replay: refused in one line (the turn loop used to drop it).
    "guess_moe_replay": (
        ["--config=configs/guess.py", *GUESS, "--config.model.preset=tiny_moe"]
        + ["--config.model.overrides.scan_unroll=1", "--config.model.moe.routing_replay=True"],
        {},
    ),
}
# Cases a check refuses: their exit code and last stderr line are what is compared.
REFUSED = ("guess_moe_replay",)


def _math_files(root: str) -> list[str]:
    """A tokenizer and small train/eval record files (as tests/train_math_test.py writes them)."""
    from helpers import save_tiny_tokenizer

    tok = save_tiny_tokenizer(os.path.join(root, "tok"), [str(i) for i in range(19)])

    def write(name, pairs):
        path = os.path.join(root, name)
        with open(path, "w") as f:
            for a, b in pairs:
                topic = "small" if a <= 4 else "large"
                row = {"problem": f"what is {a} plus {b}", "answer": str(a + b)}
                row |= {"subject": topic, "level": 1, "unique_id": f"p{a}_{b}"}
                f.write(json.dumps(row) + "\n")
        return path

    data = write("train.jsonl", [(a, b) for a in range(1, 9) for b in (1, 2)])
    evals = write("eval.jsonl", [(2, 5), (3, 6), (7, 7), (9, 9)])
    return [
        f"--config.model.tokenizer_path={tok}",
        f"--config.data.path={data}",
        f"--config.data.eval_path={evals}",
    ]


def _timing(key: str) -> bool:
    return key.startswith("perf/") or "per_s" in key or key.endswith("_s") or "time" in key


def run_case(name: str, out: str, scratch: str, root: str = ROOT) -> list[dict]:
    args, env = CASES[name]
    args = args + (_math_files(scratch) if name == "math_records" else [])
    workdir = os.path.join(scratch, name)
    cmd = [sys.executable, "experiments/train.py", *args, f"--config.workdir={workdir}"]
    env = {**os.environ, **env}
    proc = subprocess.run(cmd, check=False, cwd=root, env=env, capture_output=True, text=True)
    if name in REFUSED:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        rows = [{"exit": proc.returncode, "stderr": last}]
    elif proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    else:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        rows = [{k: v for k, v in r.items() if not _timing(k)} for r in rows]
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(rows, f)
    return rows


def compare(name: str, rows: list[dict], before_dir: str) -> str:
    with open(os.path.join(before_dir, f"{name}.json")) as f:
        before = json.load(f)
    if len(before) != len(rows):
        return f"differs: {len(before)} rows before, {len(rows)} after"
    for i, (a, b) in enumerate(zip(before, rows)):
        if a != b:
            keys = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
            return f"differs at row {i}: {', '.join(keys[:5])}"
    return f"bitwise equal ({len(rows)} rows, {sum(map(len, rows))} values)"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--compare", default="")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--root", default=ROOT, help="the source tree to train with (an old checkout)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for name in a.cases.split(","):
        with tempfile.TemporaryDirectory() as scratch:
            rows = run_case(name, a.out, scratch, a.root)
        verdict = compare(name, rows, a.compare) if a.compare else f"{len(rows)} rows"
        print(f"| {name} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
