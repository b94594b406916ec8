"""Run-time services: storage, workdir, checkpoints, metrics, progress, processes, deadlines."""
