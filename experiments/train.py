"""Train a policy with EBPO: `python experiments/train.py [--config=configs/x.py] [--config.f=v]`."""

import os

from absl import logging

from ebpo_jax import cli

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "tiny.py")
_CONFIG = cli.define_config("config", os.path.normpath(_DEFAULT), "Training config.")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    from ebpo_jax.runtime import distributed

    distributed.initialize()  # pods: every worker runs this command; no-op on one host
    from ebpo_jax.runtime import storage

    log_dir = storage.host_local(_CONFIG.value.workdir)  # gs://: a local file on each host
    cli.divert_logs(os.path.join(log_dir, "orbax.log"))
    from ebpo_jax.trainer.loop import train  # after flag parsing, so --help stays fast

    s = train(_CONFIG.value)
    if not distributed.is_main_process():
        return
    from ebpo_jax.runtime.progress import summary

    print(summary(s, _CONFIG.value))


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    cli.run(main)
