"""A grid config -> the list of training runs it means, and each run's training config.

A grid (configs/ablations/*.py) names a base training config and `blocks`; each block is
the product of its `axes` (lists of values) on top of its `fixed` overrides. Axis and
override names are training-config keys (dotted, or nested dicts in `fixed`), plus:
  method     a name in METHODS (a bundle of overrides: estimator, loss, DAPO options);
  lr         optimizer.learning_rate;
  order      task.order (or data.order when the base trains on math data).
A block with `rollouts_per_step` > 0 compares at equal sample budget: prompts_per_step =
rollouts_per_step // group_size, so every run generates the same number of responses.
"""

import dataclasses
import importlib.util
import itertools
import os
import re
from typing import Any

import ml_collections

from ebpo_jax.schema import ConfigError

# Each method is the set of config overrides that makes the trainer run it.
METHODS: dict[str, dict[str, Any]] = {
    "grpo": {"estimator": "grpo"},
    # Dr. GRPO: no std division, and a constant-length token-sum normaliser.
    "dr_grpo": {"estimator": "dr_grpo", "loss.agg": "seq-mean-token-sum-norm"},
    # DAPO: GRPO advantages, dynamic sampling (all-equal groups refilled), clip-higher.
    "dapo": {"estimator": "grpo", "dapo.dynamic_sampling": True, "loss.clip_high": 0.28},
    # EBPO as in the paper: one global prior carried across steps.
    "ebpo": {"estimator": "ebpo", "eb_clusters": "none"},
    # Control: batch-standardised advantages around the group mean (EBPO's scale, GRPO's
    # baseline), which separates the shrunk baseline from the change of step size.
    "rpp": {"estimator": "reinforce_pp_baseline"},
    "rloo": {"estimator": "rloo"},  # leave-one-out mean baseline
    # Clip-Cov (Cui et al. 2025; the paper's fourth baseline): GRPO advantages, the clip_cov loss.
    "clip_cov": {"estimator": "grpo", "loss.name": "clip_cov"},
    # EBPO variants.
    "ebpo_per_batch": {
        "estimator": "ebpo",
        "eb_clusters": "none",
        "estimator_options.per_batch": True,
    },
    "ebpo_cluster": {"estimator": "ebpo", "eb_clusters": "cell"},  # topic x difficulty (toy)
    "ebpo_topic": {"estimator": "ebpo", "eb_clusters": "topic"},  # math data: one prior per topic
    "ebpo_forget": {
        "estimator": "ebpo",
        "eb_clusters": "none",
        "estimator_options.forgetting": 0.95,
    },
}
# The toy-scale recipe every CPU grid shares: the tiny default's warm-started policy,
# 100 steps at lr 5e-4 (the tiny default's 2e-4 learns too little in 100 steps), 4 eval
# samples per held-out problem every 25 steps.
CPU_BASE_CONFIG = "configs/tiny.py"
CPU_FIXED = {
    "total_steps": 100,
    "eval_every": 25,
    "eval_samples": 4,
    "checkpoint_every": 50,
    "keep_checkpoints": 1,
    "lr": 5e-4,
}
_ALIASES = {"lr": "optimizer.learning_rate", "order": "task.order"}
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a grid: its block, its axis values and its config overrides."""

    block: str
    values: tuple[tuple[str, Any], ...]  # (axis, value) in the block's axis order
    overrides: tuple[tuple[str, Any], ...]  # dotted config key -> value, applied in order

    @property
    def run_id(self) -> str:
        """A stable, filesystem-safe name: block__axis-value__..."""
        parts = [self.block] + [f"{a}-{v}" for a, v in self.values]
        return re.sub(r"[^A-Za-z0-9_.=-]", "_", "__".join(parts))

    def value(self, axis: str, default=None):
        return dict(self.values).get(axis, default)


def _flatten(overrides, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested override dicts ({"optimizer": {"learning_rate": x}}) as dotted (key, value)s."""
    out = []
    for k, v in dict(overrides).items():
        key = _ALIASES.get(prefix + k, prefix + k)
        out += (
            _flatten(v, key + ".")
            if isinstance(v, (dict, ml_collections.ConfigDict))
            else [(key, v)]
        )
    return out


def _method(name: str) -> dict[str, Any]:
    if name not in METHODS:
        raise ConfigError(f"method={name!r} unknown; known: {sorted(METHODS)}")
    return METHODS[name]


def expand(grid: ml_collections.ConfigDict) -> list[Run]:
    """Every run of every block of `grid`, block by block, axes varying last-fastest."""
    runs, seen = [], set()
    for i, block in enumerate(grid.blocks):
        name = block.get("name") or f"block{i}"
        axes = dict(block.get("axes", {}))
        budget = int(block.get("rollouts_per_step", 0))
        for a, vals in axes.items():
            if not isinstance(vals, (list, tuple)) or not vals:
                raise ConfigError(f"grid block {name!r}: axis {a!r} needs a non-empty list")
        for combo in itertools.product(*axes.values()):
            values = tuple(zip(axes, combo))
            over = _flatten(grid.get("fixed", {})) + _flatten(block.get("fixed", {}))
            for a, v in values:
                if a == "method":
                    over += list(_method(v).items())
                else:
                    over.append((_ALIASES.get(a, a), v))
            if budget:
                g = dict(over).get("group_size")
                if not g or budget % g:
                    raise ConfigError(
                        f"grid block {name!r}: rollouts_per_step={budget} needs a group_size "
                        f"that divides it, got {g}"
                    )
                over.append(("prompts_per_step", budget // g))
            run = Run(name, values, tuple(over))
            if run.run_id in seen:
                raise ConfigError(f"grid block {name!r}: run {run.run_id} appears twice")
            seen.add(run.run_id)
            runs.append(run)
    return runs


def with_seeds(grid: ml_collections.ConfigDict, seeds) -> ml_collections.ConfigDict:
    """A copy of `grid` whose every block runs `seeds` (its `seed` axis replaced or added)."""
    out = ml_collections.ConfigDict(grid.to_dict())
    blocks = []
    for block in out.blocks:
        block = dict(block)
        block["axes"] = {**dict(block.get("axes", {})), "seed": [int(s) for s in seeds]}
        blocks.append(block)
    out.blocks = blocks
    return out


def load_config_file(path: str, *args) -> ml_collections.ConfigDict:
    """`get_config(*args)` of a config file (relative paths are from the repository root)."""
    full = path if os.path.isabs(path) else os.path.join(REPO, path)
    if not os.path.exists(full):
        raise ConfigError(f"base_config {path!r}: no such file ({full})")
    spec = importlib.util.spec_from_file_location("_base_config", full)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(*args)


def run_config(base: ml_collections.ConfigDict, run: Run, workdir: str):
    """The training config of `run`: `base` with the run's overrides, in `workdir`."""
    config = ml_collections.ConfigDict(base.to_dict())  # an unlocked copy
    for key, value in run.overrides + (("workdir", workdir),):
        if key == "task.order" and config.get("data") is not None and config.data.get("path"):
            key = "data.order"
        *parents, leaf = key.split(".")
        node = config
        for p in parents:
            if p not in node:
                raise ConfigError(f"run {run.run_id}: unknown config field {key!r}")
            node = node[p]
        # estimator_options is free-form; anything else must already exist.
        if leaf not in node and parents != ["estimator_options"]:
            raise ConfigError(f"run {run.run_id}: unknown config field {key!r}")
        node[leaf] = value
    return config
