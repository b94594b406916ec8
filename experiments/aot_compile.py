"""Compile the trainer's and sampler's programs for a TPU or GPU topology here; report memory.

  python experiments/aot_compile.py --config=configs/qwen3_8b.py --topology=v5p-64
  python experiments/aot_compile.py --config=configs/gpu/qwen3_8b_h100.py:aot --topology=8xH100

Needs libtpu (`pip install -e '.[tpu]'`) or the CUDA plugin (`pip install -e '.[gpu-aot]'`,
best in a venv of its own), no TPU or GPU. Prints a per-device table and writes JSON;
exits 1 when a program does not fit in HBM.
"""

import json
import os
import sys

# Compiling for a topology needs no TPU here: keep JAX on the CPU, and libtpu unlocked.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import flags

from ebpo_jax import cli

_CONFIG = cli.define_config("config", None, "Training config.")
_TOPOLOGY = flags.DEFINE_string(
    "topology", "v5p-64", "e.g. v5p-64, v5e-64, v6e-64, v5p:2x4x4, 8xH100, 8xH200, 2x8xH100."
)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 4096, "Padded prompt width (max prompt tokens).")
_SAMPLER_PROMPTS = flags.DEFINE_integer(
    "sampler_prompts",
    None,
    "Prompts per sampler call (0 = prompts_per_step); default: config.sampler.prompts_per_call.",
)
_SAMPLER_MESH = flags.DEFINE_string(
    "sampler_mesh",
    None,
    "Sampler mesh, e.g. 'data=8,tp=4' ('' = the trainer's mesh); default: config.sampler.mesh.",
)
_TRAINER_DEVICES = flags.DEFINE_integer(
    "trainer_devices",
    0,
    "Split the topology as rollout.max_staleness=1 does: the trainer's mesh on the first n "
    "devices, --sampler_mesh on the rest (0 = colocated, both on every device).",
)
_UPDATE_ONLY = flags.DEFINE_bool(
    "update_only", False, "Compile the train update alone (no weight move, no sampler)."
)
_GENERATED_PER_KEPT = flags.DEFINE_float(
    "generated_per_kept",
    None,
    "DAPO's dynamic sampling: tokens generated per kept token in the step estimate (e.g. a "
    "run's dapo/generated_per_kept); default: aot_report.DAPO_GENERATED_PER_KEPT.",
)
_ESTIMATE_ONLY = flags.DEFINE_bool(
    "estimate_only", False, "Print and write the step estimate and layout; compile nothing."
)
_OUT = flags.DEFINE_string("out", "aot_report.json", "Where to write the JSON report.")
_MEMO = flags.DEFINE_string(
    "memo",
    "",
    "Folder of compiled programs' memory reports (pods/aot_memo.py): a program byte-identical "
    "to one compiled before reuses its report ('' = compile everything).",
)


def _label() -> str:
    """This run in the memo entries it writes: the report's file name."""
    return os.path.basename(_OUT.value)


def main(argv):
    del argv
    from ebpo_jax.pods import (
        aot,
        aot_memo,
        aot_report,  # after flag parsing, so --help stays fast
    )

    reason = aot_report.compiler_unavailable(_TOPOLOGY.value)
    if reason:
        sys.exit(f"cannot compile for {_TOPOLOGY.value} here: {reason}")
    config = _CONFIG.value
    prompts, s_mesh = _SAMPLER_PROMPTS.value, _SAMPLER_MESH.value
    prompts = config.sampler.prompts_per_call if prompts is None else prompts
    s_mesh = config.sampler.mesh if s_mesh is None else s_mesh
    try:
        spec = aot.resolve_for(
            config, _TOPOLOGY.value, sampler_mesh=s_mesh, trainer_devices=_TRAINER_DEVICES.value
        )
        reports, meta = aot.run(
            spec,
            _TOPOLOGY.value,
            aot.Workload(_PROMPT_LEN.value, prompts or None, _GENERATED_PER_KEPT.value),
            programs="none" if _ESTIMATE_ONLY.value else "update" if _UPDATE_ONLY.value else "all",
            memo=_MEMO.value and aot_memo.Memo(_MEMO.value, _TOPOLOGY.value, _label()),
        )
    except Exception as e:  # the compiler's out-of-memory error names no program: say which
        if aot_report.is_resource_exhausted(e):
            sys.exit(f"does not fit on {_TOPOLOGY.value}: RESOURCE_EXHAUSTED\n{str(e)[:2000]}")
        raise
    print(json.dumps({k: v for k, v in meta.items() if k != "model"}))
    print(aot_report.format_table(reports))
    for r in reports:
        if r.note:
            print(f"  {r.name}: {r.note}")
        if r.memo:
            print(f"  {r.name}: {r.memo} (memo {r.memo_key[:16]})")
    for line in aot_report.paged_lines(meta) + aot_report.exact_on_policy_lines(meta):
        print(f"  {line}")
    resident_lines, resident_bad = aot_report.resident_check(reports)
    for line in resident_lines:
        print(f"  {line}")
    aot_report.write_json(_OUT.value, reports, **meta)
    print(f"report: {_OUT.value}")
    bad = [r.name for r in reports if not r.fits] + resident_bad
    if bad:
        sys.exit(
            f"does not fit in {reports[0].hbm_bytes / aot_report.GiB:.0f} GiB HBM: {', '.join(bad)}"
        )


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    flags.mark_flag_as_required("config")
    # Off by default: JAX writes the deviceless compiles to its persistent cache but cannot
    # read them back (ebpo_jax/pods/aot_memo.py), so they would only fill the user's cache.
    cli.run(main, compilation_cache=False)
