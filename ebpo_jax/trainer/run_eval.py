"""Evaluate a training run's checkpoint on its own task's held-out sets, with intervals.

`evaluate_run(workdir, step=None)` rebuilds the run's task from `<workdir>/config.json` (any
family: the held-out split depends on the config alone), loads the checkpoint's policy and
samples k answers per held-out problem, as the training-time evaluation does, then reports
mean@k and pass@k per set with bootstrap intervals (`ebpo_jax.evaluation.summarize`).
"""

import json
import os

import jax
import ml_collections

from ebpo_jax import evaluation
from ebpo_jax.config import ConfigError, default_config, finalize
from ebpo_jax.models.lora_checkpoint import EXTRA_KEY, policy_of_run
from ebpo_jax.runtime import storage
from ebpo_jax.runtime.checkpoint import Checkpointer, list_steps
from ebpo_jax.sharding import make_mesh
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import build_task


def run_config(workdir: str, k: int | None = None) -> ml_collections.ConfigDict:
    """The run's config.json, with k samples per held-out problem if given."""
    path = os.path.join(workdir, "config.json")
    if not storage.isfile(path):
        raise ConfigError(f"{path} does not exist: --workdir must be a training run's folder")
    config = default_config()  # fields added since the run was saved keep their defaults
    config.update(json.loads(storage.read_text(path)))
    if config.model.lora.rank == 0:
        config.sft.steps = 0  # the checkpoint replaces the initial policy: no warm start to redo
    if k is not None:
        config.eval_samples = k
    config.mesh.devices = 1  # held-out sampling needs no pod: one device
    config.mesh.shape = (1,)
    config.mesh.axes = (config.mesh.axes[0],)
    return finalize(config)


def _like(params, reference):
    """`params` (restored without a target: plain nested dicts) in `reference`'s structure."""
    leaves, want = jax.tree.leaves(params), jax.tree.leaves(reference)
    shapes = [x.shape for x in leaves] == [x.shape for x in want]
    if not shapes:
        raise ConfigError("the checkpoint's params do not match the run's model config")
    return jax.tree.unflatten(jax.tree.structure(reference), leaves)


def checkpoint_params(workdir: str, step: int | None, base_params, model_config):
    """(step, policy params) of the checkpoint `step` (default: the latest)."""
    ckpt_dir = os.path.join(workdir, "checkpoints")
    steps = list_steps(ckpt_dir)
    if not steps:
        raise ConfigError(f"{ckpt_dir} holds no checkpoint")
    if step is None or step == steps[-1]:  # LoRA: the adapters merged into the base
        return steps[-1], _like(policy_of_run(workdir, base_params, model_config), base_params)
    if step not in steps:
        raise ConfigError(f"--step={step}: {ckpt_dir} holds steps {steps}")
    with Checkpointer(ckpt_dir) as ckpt:
        state, extra = ckpt.restore(step)
    if EXTRA_KEY in extra:
        raise ConfigError(f"--step={step}: a LoRA run's earlier steps are not supported; omit it")
    return step, _like(state["params"], base_params)


def evaluate_run(workdir: str, *, step: int | None = None, k: int | None = None, out=None):
    """({set: {metric: {value, lo, hi}}}, the JSON path written) for `workdir`'s checkpoint."""
    workdir = storage.absolute(workdir)  # orbax reads absolute paths only (or gs://)
    config = run_config(workdir, k)
    spec = resolve(config, jax.device_count())
    task = build_task(spec.task, mesh=make_mesh(spec.mesh), log=lambda *_: None)
    try:
        if task.evaluate is None:
            raise ConfigError(f"{workdir}: the run's task has no held-out set")
        step, params = checkpoint_params(workdir, step, task.params, task.model_config)
        try:
            scores = task.evaluate(params, matrix=True)
        except TypeError:  # a custom family's evaluate(params) -> {set: pass@1} only
            raise ConfigError(
                f"task family {spec.task.family!r}: its evaluate() gives no per-problem scores"
            ) from None
    finally:
        task.close()
    results = {name: evaluation.summarize(s_PK) for name, s_PK in scores.items()}
    for name, s_PK in scores.items():
        print(f"{name}: {s_PK.shape[0]} problems x {s_PK.shape[1]} samples (step {step})")
    out = out or os.path.join(workdir, f"eval_step{step}.json")
    storage.write_text(out, json.dumps({"step": step, "results": results}, indent=2))
    return results, out
