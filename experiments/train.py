"""Train a policy with EBPO: `python experiments/train.py [--config=configs/x.py] [--config.f=v]`."""

import math
import os

from absl import logging

from ebpo_jax import cli

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny.py")
_CONFIG = cli.define_config("config", os.path.normpath(_DEFAULT), "Training config.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from ebpo_jax import distributed

    distributed.initialize()  # pods: every worker runs this command; no-op on one host
    from ebpo_jax.trainer.loop import train  # after flag parsing, so --help stays fast

    s = train(_CONFIG.value)
    if not distributed.is_main_process():
        return
    print(summary(s, _CONFIG.value))


def summary(s: dict, config) -> str:
    """The closing lines: the warm start's and the latest evaluated pass@1, and the outputs."""
    if math.isnan(s["pass@1_start"]) and s["pass@1_end_step"] is None:
        score = "no held-out evaluation (the task has no held-out set)"
    else:
        start = "warm start"
        if config.sft.steps == 0 and not config.model.hf_path:
            start = "untrained start: this config has no warm start, sft.steps=0"
        end = "not evaluated"
        if s["pass@1_end_step"] is not None:
            end = f"{100 * s['pass@1_end']:.1f}% (step {s['pass@1_end_step']})"
        score = f"held-out pass@1: {100 * s['pass@1_start']:.1f}% ({start}) -> {end}"
    run = f"trained to step {s['step']}" + (" (stopped early)" if s["stopped_early"] else "")
    return (
        f"{score}\n{run}, {s['wall_time_s']:.0f} s\n"
        f"workdir: {s['workdir']}\nmetrics: {s['metrics']}\ncheckpoints: {s['checkpoints']}\n"
        f"plot: python experiments/plot_run.py {s['workdir']}\n"
        f"tensorboard: tensorboard --logdir {s['workdir']}"
    )


if __name__ == "__main__":
    from ebpo_jax.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
