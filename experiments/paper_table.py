"""The paper's headline cells (configs/paper.py) with their estimated v5p-64 step times.

  python experiments/paper_table.py --reports=results/aot_tpu/paper

For each cell: the Pass@1 it reproduces, the step estimate (aot.run with programs="none": no
compile; DAPO's rows include the refill at --generated_per_kept) and, when `--reports` holds
`<model>_<method>_g<G>.json` from experiments/aot_compile.py, its compiled peak per chip.
Prints a Markdown table.
"""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from absl import flags

from ebpo_jax import cli

_REPORTS = flags.DEFINE_string("reports", "results/aot_tpu/paper", "Folder of AOT reports.")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p-64", "The pod the estimates are for.")
_GENERATED_PER_KEPT = flags.DEFINE_float(
    "generated_per_kept", None, "DAPO: tokens generated per kept token (see aot_compile.py)."
)
_CELLS = flags.DEFINE_multi_string(
    "cell", [], "Only this cell (repeatable), e.g. --cell=qwen3_8b,dapo,g4; default: all."
)
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _compiled(path: str) -> str:
    """'peak GiB / HBM GiB' of the report's largest program, or why there is none."""
    if not os.path.exists(path):
        return "not compiled yet"
    with open(path) as f:
        programs = json.load(f)["programs"]
    worst = max(programs, key=lambda p: p["peak_bytes"])
    fits = all(p["fits"] for p in programs)
    gib = lambda b: b / 2**30
    return (
        f"{'fits' if fits else 'DOES NOT FIT'}: {worst['name']} "
        f"{gib(worst['peak_bytes']):.1f} / {gib(worst['hbm_bytes']):.0f} GiB"
    )


def main(argv):
    del argv
    from ebpo_jax.config import ConfigError, load_sibling
    from ebpo_jax.pods import aot

    paper = load_sibling(os.path.join(_REPO, "configs", "x.py"), "paper.py")
    print("| cell | reproduces (Pass@1 %) | est. step s | refill x | AOT report |")
    print("|---|---|---|---|---|")
    cells = [paper.parse(c)[:3] for c in _CELLS.value] if _CELLS.value else paper.CELLS
    for model, method, g in cells:
        name = paper.cell_name(model, method, g)
        want = paper.PASS1.get((model, g), {}).get(method)
        try:
            c = paper.get_config(name + ",aot")
            spec = aot.resolve_for(c, _TOPOLOGY.value, sampler_mesh=c.sampler.mesh)
        except ConfigError as e:
            print(f"| `{name}` | {want or '-'} | - | - | {e} |")
            continue
        _, meta = aot.run(
            spec,
            _TOPOLOGY.value,
            prompt_len=4096,
            programs="none",
            generated_per_kept=_GENERATED_PER_KEPT.value,
            log=lambda *_: None,
        )
        est = meta["step_estimate"]
        refill = est.get("refill", {}).get("generated_per_kept", 1.0)
        report = os.path.join(_REPORTS.value, f"{model}_{method}_g{g}.json")
        print(
            f"| `{name}` | {want if want is not None else '-'} | {est['step_s_after']:.0f} "
            f"| {refill:g} | {_compiled(report)} |"
        )


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()
    cli.run(main)
