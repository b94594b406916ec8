"""Run one command on a Ray cluster, retried and resumed until it finishes:

    python experiments/launch.py --executor=ray --slice=v5p-64 -- \\
        python experiments/train.py --config=configs/qwen3_8b.py --config.workdir=gs://b/run

On a TPU slice the command runs once per host, the hosts gang-scheduled on one free slice
(all or none) and each given the same jax.distributed coordinator (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID); without --slice it runs as one task with --ray_cpus CPUs
and --ray_gpus GPUs. When a host's task dies (preemption, node lost, OOM) or the command
fails, every host stops and the command starts again; train.py resumes from the run's last
checkpoint. A failure seen twice in a row, or --retries exhausted, ends it with exit status 1.
"""

import sys

from absl import flags

from ebpo_jax import cli

_EXECUTOR = flags.DEFINE_enum("executor", "ray", ["ray"], "Where the command runs.")
_RAY_ADDRESS = flags.DEFINE_string(
    "ray_address", "auto", "Ray cluster: 'auto' joins this node's, ray://host:10001, '' a new one."
)
_SLICE = flags.DEFINE_string("slice", "", "TPU slice type, e.g. v5p-64: one task per host.")
_RAY_CPUS = flags.DEFINE_float("ray_cpus", 1.0, "CPUs of the task (without --slice).")
_RAY_GPUS = flags.DEFINE_float("ray_gpus", 0.0, "GPUs of the task (without --slice).")
_RETRIES = flags.DEFINE_integer("retries", 3, "Restarts after a task died or the command failed.")


def main(argv):
    command = argv[1:]
    if not command:
        sys.exit("give the command after --: launch.py --slice=v5p-64 -- python experiments/...")
    from tqdm.auto import tqdm

    from ebpo_jax.ablation import ray_executor
    from ebpo_jax.ablation.executor import Progress

    resources = ray_executor.RayResources(_RAY_CPUS.value, _RAY_GPUS.value, _SLICE.value)
    executor = ray_executor.RayExecutor(_RAY_ADDRESS.value, resources, _RETRIES.value)
    progress = Progress(tqdm(disable=True), total=1, done=0)
    try:
        done = executor.run([("command", ray_executor.CommandWork(tuple(command)))], progress)
    finally:
        executor.close()
    sys.exit(0 if done else 1)


if __name__ == "__main__":
    cli.run(main)
