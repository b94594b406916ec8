"""Measured phase times vs the step-time estimate: python experiments/estimate_check.py
[--config=configs/micro.py] [--steps=6] [--out=report.json].

Trains the config for a few steps in a fresh workdir (K = 1: each phase timed), then prints
each phase's median time beside `step_time_estimate`'s for the same config on this device:
a TPU or GPU by its kind, a CPU by its own peak numbers, measured here (ebpo_jax.pods.estimate_check).
"""

import json
import os
import tempfile

from absl import flags, logging

from ebpo_jax import cli

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "micro.py")
_CONFIG = cli.define_config("config", os.path.normpath(_DEFAULT), "The config to time.")
_STEPS = flags.DEFINE_integer("steps", 6, "Steps to run (the first compiles and is not timed).")
_OUT = flags.DEFINE_string("out", "", "Also write the numbers as JSON here.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax

    from ebpo_jax.pods import estimate_check as ec
    from ebpo_jax.runtime.metrics import read_metrics
    from ebpo_jax.spec import resolve
    from ebpo_jax.tasks.protocol import build_task
    from ebpo_jax.trainer.loop import train

    c = _CONFIG.value
    c.unlock()
    name = c.workdir  # the config's own run name (runs/micro)
    c.total_steps, c.steps_per_jit = _STEPS.value, 1
    c.eval_every = c.checkpoint_every = max(2, _STEPS.value // 2)
    with tempfile.TemporaryDirectory() as workdir:
        c.workdir = workdir
        train(c, log=lambda _: None)
        rows = read_metrics(workdir)
    spec = resolve(c, jax.device_count())
    task = build_task(spec.task, log=lambda _: None)
    try:
        prompt_len = task.source.next_batches(1).prompt_tokens.shape[-1]
    finally:
        task.close()
    chip = ec.device_chip(jax.devices()[0])
    plen = int(prompt_len)
    est = ec.estimate(spec, task.model_config, chip, plen, ec.measured_lengths(rows, plen))
    measured = ec.measured_phases(rows)
    print(f"{_STEPS.value} steps of {name} on "
          f"{jax.devices()[0].device_kind}, prompt width {plen}")  # fmt: skip
    print(ec.report(measured, est, spec, chip))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(ec.as_json(measured, est, chip), f, indent=2)


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()
    cli.run(main)
