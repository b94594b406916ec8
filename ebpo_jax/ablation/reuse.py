"""Adopt finished runs of other grids whose training config is the same as a run's.

Grids share runs: the reasoning `group_size` grid's GRPO and EBPO at G=4 are the `pilot`
grid's runs under another name. A grid config's `reuse` lists other grids' out_dirs; a
finished run there whose saved config.json equals this run's config in every field but
`workdir` is copied in (summary, metrics, config; not its checkpoints) with a
`reused_from.txt` naming the source, instead of being trained again. Training is
deterministic for a given config, code, jaxlib and XLA flags (`ablate.py --rerun` checks
it), so the copy is the run; it keeps the provenance it was trained with, and its XLA flags
may differ from the adopting grid's (one XLA thread per worker with --workers > 1).
"""

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ebpo_jax.runtime import workdir as workdir_lib

# Copied from the source run; checkpoints and TensorBoard logs stay there.
FILES = ("summary.json", workdir_lib.METRICS_FILE, workdir_lib.CONFIG_FILE)
MARKER = "reused_from.txt"
# Where a run trains, where it exports its warm start, and whether it started over after
# a kill before its first checkpoint (the grid sets `restart`) do not change what it computes.
_IGNORED = ("workdir", "sft.export_dir", "restart")


def _finished(folder: str) -> Iterable[str]:
    runs = os.path.join(folder, "runs")
    if not os.path.isdir(runs):
        return []
    return sorted(
        os.path.join(runs, d)
        for d in os.listdir(runs)
        if os.path.exists(os.path.join(runs, d, "summary.json"))
        and os.path.exists(os.path.join(runs, d, workdir_lib.CONFIG_FILE))
    )


def same_run(saved: Mapping[str, Any], config: Mapping[str, Any]) -> bool:
    """True when two training configs differ in no field outside _IGNORED."""
    return all(k in _IGNORED for k in workdir_lib.config_diff(saved, config))


def find(config: Mapping[str, Any], sources: Iterable[str]) -> str | None:
    """The first finished run in the `sources` grids' runs/ trained with `config`."""
    for folder in sources:
        for run_dir in _finished(folder):
            with open(os.path.join(run_dir, workdir_lib.CONFIG_FILE), encoding="utf-8") as f:
                if same_run(json.load(f), config):
                    return run_dir
    return None


def adopt(
    configs: Mapping[str, Any],
    runs_dir: str,
    sources: Iterable[str],
    log: Callable[[str], None] = print,
) -> list[str]:
    """Copy in every unfinished run of `configs` (run id -> config) found in `sources`."""
    sources = [os.path.abspath(s) for s in sources]
    adopted = []
    for run_id, config in configs.items():
        dst = os.path.join(runs_dir, run_id)
        if os.path.exists(os.path.join(dst, "summary.json")):
            continue
        src = find(config.to_dict() if hasattr(config, "to_dict") else config, sources)
        if src is None or os.path.abspath(src) == os.path.abspath(dst):
            continue
        if os.path.isdir(dst):
            shutil.rmtree(dst)  # a partial run of the same config: the finished one replaces it
        os.makedirs(dst)
        for name in FILES:
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
        with open(os.path.join(dst, MARKER), "w", encoding="utf-8") as f:
            f.write(src + "\n")
        log(f"  reused  {run_id} <- {src}")
        adopted.append(run_id)
    return adopted
