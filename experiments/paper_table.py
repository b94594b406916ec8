"""The paper's headline cells (configs/paper.py) with their estimated v5p-64 step times.

  python experiments/paper_table.py --reports=results/aot_tpu/paper

For each cell: the Pass@1 it reproduces, the step estimate at peak and expected (aot.run with
programs="none": no compile; DAPO's rows include the refill at --generated_per_kept) and,
when `--reports` holds `<model>_<method>_g<G>.json` from experiments/aot_compile.py, how
many of its programs were compiled or reused from the memo, its largest program's peak per
chip (a sampler program's with the train state resident) and whether every program fits.
Cells without a report say "pending". Prints a Markdown table.
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


def _programs(path: str) -> list | None:
    """The report's ProgramReports, or None when the cell is not compiled yet."""
    import dataclasses

    from ebpo_jax.pods.aot_report import ProgramReport

    if not os.path.exists(path):
        return None
    with open(path) as f:
        programs = json.load(f)["programs"]
    names = {f.name for f in dataclasses.fields(ProgramReport)}
    return [ProgramReport(**{k: v for k, v in p.items() if k in names}) for p in programs]


def _compiled(reports: list | None) -> tuple[str, str, str]:
    """(how its programs were compiled, worst GiB per chip with the train state, fits)."""
    from ebpo_jax.pods.aot_report import GiB, resident_check

    if reports is None:
        return "pending", "-", "-"
    resident = next((r.argument_bytes for r in reports if r.name == "train update"), 0)
    on_chip = lambda r: r.peak_bytes + r.code_bytes + resident * r.name.startswith("sampler")
    worst = max(reports, key=on_chip)
    fits = all(r.fits for r in reports) and not resident_check(reports)[1]
    reused = sum(r.memo.startswith("reused") for r in reports)
    how = f"{len(reports) - reused} compiled, {reused} reused" if reused else "all compiled"
    gib = f"{on_chip(worst) / GiB:.1f} / {worst.hbm_bytes / GiB:.0f} ({worst.name})"
    return how, gib, "yes" if fits else "**NO**"


def main(argv):
    del argv
    from ebpo_jax.config import ConfigError, load_sibling
    from ebpo_jax.pods import aot

    paper = load_sibling(os.path.join(_REPO, "configs", "x.py"), "paper.py")
    print(
        "| cell | reproduces (Pass@1 %) | v5p-64 AOT programs | peak GiB per chip with the "
        "train state / HBM | fits | est. step s, peak / expected | refill x |"
    )
    print("|---|---|---|---|---|---|---|")
    cells = [paper.parse(c)[:3] for c in _CELLS.value] if _CELLS.value else paper.CELLS
    for model, method, g in cells:
        name = paper.cell_name(model, method, g)
        want = paper.PASS1.get((model, g), {}).get(method)
        want = "(no column in the table)" if want is None else want
        try:
            c = paper.get_config(name + ",aot")
            spec = aot.resolve_for(c, _TOPOLOGY.value, sampler_mesh=c.sampler.mesh)
        except ConfigError as e:
            print(f"| `{name}` | {want} | - | - | - | - | {e} |")
            continue
        _, meta = aot.run(
            spec,
            _TOPOLOGY.value,
            aot.Workload(4096, generated_per_kept=_GENERATED_PER_KEPT.value),
            programs="none",
            log=lambda *_: None,
        )
        est = meta["step_estimate"]
        refill = est.get("refill", {}).get("generated_per_kept", 1.0)
        report = os.path.join(_REPORTS.value, f"{model}_{method}_g{g}.json")
        how, gib, fits = _compiled(_programs(report))
        print(
            f"| `{name}` | {want} | {how} | {gib} | {fits} "
            f"| {est['step_s_after']:.0f} / {est['step_s_expected']:.0f} | {refill:g} |"
        )


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()
    cli.run(main)
