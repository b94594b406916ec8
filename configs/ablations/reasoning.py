"""The ablations on the reasoning-length task (configs/reasoning.py: 16-64-token chains).

`--config=configs/ablations/reasoning.py:<part>`, part one of
  pilot        EBPO vs GRPO at G=4: the pilot whose paired-difference std sizes the others;
  small_g      EBPO vs GRPO at G=2, the same budget: where the paper expects EBPO's largest gain;
  g8           EBPO vs GRPO at G=8, the same budget (with pilot and small_g: G <= 8 at full
               power, the seeds the pilot's power analysis chose);
  group_size   method x G in {2, 4, 8} at an equal budget of 128 responses per step (EBPO,
               GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) plus one DAPO row at G=4;
  g16          the same five methods at G=16 (8 prompts per step), run last;
  variants     the EBPO priors (carried, per-batch, per (topic, difficulty) cell,
               forgetting) against GRPO at G=4;
  curriculum   naive, topic and easy-to-hard orders for GRPO and EBPO at G=4;
  int8         issue 46's learning check: the sampler's KV pages and its weights each
               float32 or int8 (2 x 2), EBPO at G=8, 3 seeds, every arm recomputing the old
               log-probs with TIS (so `mismatch/*` shows the sampler/trainer gap).
               Rule, stated before the runs: an int8 arm learns unchanged when its 3-seed
               mean of final held-out pass@1 lies within the float32 arm's seed band (the
               min and max of its 3 seeds); the paired mean difference is reported beside.
Seeds: give them by power analysis, e.g.
  python experiments/ablate.py --config=configs/ablations/reasoning.py:group_size \\
      --power_effect=0.02 --power=0.8 --pilot_seeds=4 --max_seeds=20
(the seed lists below are the pilot's default and are replaced by --power_effect; a
cross-grid claim's cells get more with --seeds=N --only=REGEX, N from claims.py's
`seeds for` column).
Every part reuses the finished runs of the parts before it that have the same training
config (`reuse`: the G=4 GRPO and EBPO runs are the pilot's, G=2 and G=8 small_g's and g8's).
"""

import ml_collections

from ebpo_jax.ablation.results import contrast as _vs  # `a` minus `b` in a part, by seed

BUDGET = 128  # responses per step, every G
NAME = "reasoning task"
CLAIMS_OUT = "results/ablations/reasoning_claims.md"  # experiments/claims.py writes it
COMPARE = "configs/ablations/arithmetic_claims.py"  # the same claims on the arithmetic task
FIXED = {
    "total_steps": 200,
    "eval_every": 50,
    "eval_samples": 4,
    "checkpoint_every": 50,
    "keep_checkpoints": 1,
}
SEEDS = [0, 1, 2, 3]


# The claims `experiments/claims.py` tests, stated before the runs they read. Each is the
# seed-paired difference sum(plus) - sum(minus) of final held-out pass@1; direction +1 is
# the paper's (or, marked, this project's) prediction, 0 a reference with no prediction.
_EBPO4 = ("group_size", {"block": "budget", "method": "ebpo", "group_size": 4})
_DAPO4 = ("group_size", {"block": "dapo", "method": "dapo"})
_BUDGET4 = {"block": "budget", "group_size": 4}  # GRPO G=4 also sits in the dapo block
CLAIMS = [
    _vs("EBPO beats GRPO at G=2", "small_g", "ebpo", "grpo"),
    _vs("EBPO beats GRPO at G=4", "pilot", "ebpo", "grpo"),
    _vs("EBPO beats GRPO at G=8", "g8", "ebpo", "grpo"),
    _vs("EBPO beats GRPO at G=16", "g16", "ebpo", "grpo"),
    {
        "claim": "the gain shrinks with G: (EBPO - GRPO at G=2) - (at G=16)",
        "direction": 1,
        "plus": [("small_g", {"method": "ebpo"}), ("g16", {"method": "grpo"})],
        "minus": [("small_g", {"method": "grpo"}), ("g16", {"method": "ebpo"})],
    },
    _vs("EBPO beats Dr. GRPO at G=4", "group_size", "ebpo", "dr_grpo", **_BUDGET4),
    {"claim": "EBPO beats DAPO at G=4", "direction": 1, "plus": [_EBPO4], "minus": [_DAPO4]},
    _vs("EBPO-topic beats EBPO-naive", "curriculum", "topic", "naive", 1, "order", method="ebpo"),
    _vs(
        "EBPO-diff beats EBPO-naive", "curriculum", "difficulty", "naive", 1, "order", method="ebpo"
    ),
    _vs(
        "(project) the gain is the shrunk baseline: EBPO beats RPP at G=2",
        "group_size",
        "ebpo",
        "rpp",
        block="budget",
        group_size=2,
    ),
    _vs("(project) EBPO beats RPP at G=4", "group_size", "ebpo", "rpp", **_BUDGET4),
    _vs("reference: RLOO - GRPO at G=4", "group_size", "rloo", "grpo", 0, **_BUDGET4),
    _vs("reference: Dr. GRPO - GRPO at G=4", "group_size", "dr_grpo", "grpo", 0, **_BUDGET4),
    _vs("reference: DAPO - GRPO at G=4", "group_size", "dapo", "grpo", 0, block="dapo"),
    _vs("reference: GRPO topic - naive", "curriculum", "topic", "naive", 0, "order", method="grpo"),
    _vs(
        "reference: GRPO difficulty - naive",
        "curriculum",
        "difficulty",
        "naive",
        0,
        "order",
        method="grpo",
    ),
    _vs("variant: per-batch statistics - paper EBPO", "variants", "ebpo_per_batch", "ebpo", 0),
    _vs("variant: per-cell priors - paper EBPO", "variants", "ebpo_cluster", "ebpo", 0),
    _vs("variant: forgetting 0.95 - paper EBPO", "variants", "ebpo_forget", "ebpo", 0),
]
# The claims' history that git and the runs' hashes do not show (experiments/claims.py adds
# it to the registration column); issue 32 has the account.
_EXTENDED = (
    "cells extended once after a first look, by a rule written after the extensions "
    "(simulated type-I error 0.05-0.08)"
)
NOTES = {
    "EBPO beats GRPO at G=2": _EXTENDED,
    "the gain shrinks with G: (EBPO - GRPO at G=2) - (at G=16)": _EXTENDED,
    "EBPO beats DAPO at G=4": _EXTENDED + "; DAPO generates 3x the tokens",
    "EBPO-topic beats EBPO-naive": _EXTENDED,
    "(project) the gain is the shrunk baseline: EBPO beats RPP at G=2": _EXTENDED,
}
PARTS = ("pilot", "small_g", "g8", "group_size", "g16", "variants", "curriculum", "int8")
BASELINES = ["grpo", "dr_grpo", "rloo", "rpp", "ebpo"]


def _block(name: str, axes: dict, **rest) -> dict:
    """One block of a part's grid at the budget of responses per step (`rest`: more fields)."""
    return {"name": name, "axes": axes, "rollouts_per_step": BUDGET, **rest}


def _pair(part: str) -> list[dict]:
    """small_g / g8: seed-major, so a grid cut short still holds whole pairs."""
    size = 2 if part == "small_g" else 8
    return [_block(part, {"seed": SEEDS, "method": ["grpo", "ebpo"], "group_size": [size]})]


def _budget(part: str) -> list[dict]:
    """group_size (G = 2, 4, 8 and one DAPO block) or g16: the baselines at the budget."""
    sizes = [2, 4, 8] if part == "group_size" else [16]
    budget = _block("budget", {"method": BASELINES, "group_size": sizes, "seed": SEEDS})
    if part == "g16":
        return [budget]
    dapo = _block("dapo", {"method": ["grpo", "dapo"], "group_size": [4], "seed": SEEDS})
    return [budget, dapo]


def _int8(part: str) -> list[dict]:
    """The sampler's KV pages x its weights, float32 or int8, every arm with the recompute
    and TIS so `mismatch/*` is logged."""
    axes = {
        "seed": [0, 1, 2],
        "method": ["ebpo"],
        "group_size": [8],
        "sampler.kv_dtype": ["", "int8"],
        "sampler.param_dtype": ["", "int8"],
    }
    fixed = {"loss.recompute_old_logprobs": True, "loss.is_correction": "tis"}
    return [_block("int8", axes, fixed=fixed)]


def _curriculum(part: str) -> list[dict]:
    """naive, topic and easy-to-hard orders for GRPO and EBPO at G=4 (32 prompts a step)."""
    axes = {"method": ["grpo", "ebpo"], "order": ["naive", "topic", "difficulty"], "seed": SEEDS}
    return [
        {"name": "order", "axes": axes, "fixed": {"group_size": 4, "prompts_per_step": BUDGET // 4}}
    ]


def _at_g4(part: str) -> list[dict]:
    """pilot (EBPO vs GRPO) or variants (the EBPO priors against GRPO), at G=4."""
    if part == "pilot":
        name, methods = "pilot", ["grpo", "ebpo"]
    else:
        name, methods = "variant", ["grpo", "ebpo", "ebpo_per_batch", "ebpo_cluster", "ebpo_forget"]
    return [_block(name, {"method": methods, "group_size": [4], "seed": SEEDS})]


_BUILDERS = {
    "pilot": _at_g4,
    "variants": _at_g4,
    "small_g": _pair,
    "g8": _pair,
    "group_size": _budget,
    "g16": _budget,
    "int8": _int8,
    "curriculum": _curriculum,
}


def _blocks(part: str) -> list[dict]:
    return _BUILDERS[part](part)


def get_config(part: str = "group_size"):
    if part not in PARTS:
        raise ValueError(f"configs/ablations/reasoning.py:{part}: part must be one of {PARTS}")
    c = ml_collections.ConfigDict()
    c.name = f"reasoning_{part}"
    c.base_config = "configs/reasoning.py"
    c.out_dir = f"results/ablations/reasoning_{part}"
    c.fixed = dict(FIXED)
    c.blocks = _blocks(part)
    c.reuse = [f"results/ablations/reasoning_{p}" for p in PARTS[: PARTS.index(part)]]
    return c
