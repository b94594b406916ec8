"""experiments/claims.py: seed-paired claims over several grids' results, Holm, verdicts."""

import os

import numpy as np
import pandas as pd
import pytest
from conftest import load_experiment
from scipy import stats

from ebpo_jax.ablation import power

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _claims():
    return load_experiment("claims")


def _finals(values: dict) -> pd.DataFrame:
    """Final rows: (method, group_size) -> pass@1 per seed."""
    rows = [
        {"method": m, "group_size": g, "seed": s, "pass@1": v}
        for (m, g), per_seed in values.items()
        for s, v in enumerate(per_seed)
    ]
    return pd.DataFrame(rows)


def test_claims_pair_by_seed_across_parts_and_apply_holm():
    c = _claims()
    rng = np.random.default_rng(0)
    grpo2, ebpo2 = rng.uniform(0.1, 0.3, 5), rng.uniform(0.1, 0.3, 5)
    grpo16, ebpo16 = rng.uniform(0.1, 0.3, 5), rng.uniform(0.1, 0.3, 5)
    parts = {
        "a": _finals({("grpo", 2): grpo2, ("ebpo", 2): ebpo2}),
        # seed 4 is missing from part b: contrasts pair the seeds both parts hold
        "b": _finals({("grpo", 16): grpo16[:4], ("ebpo", 16): ebpo16[:4]}),
    }
    claims = [
        {"claim": "g2", "direction": 1, "plus": [("a", {"method": "ebpo"})],
         "minus": [("a", {"method": "grpo"})]},
        {"claim": "shrinks", "direction": 1,
         "plus": [("a", {"method": "ebpo"}), ("b", {"method": "grpo"})],
         "minus": [("a", {"method": "grpo"}), ("b", {"method": "ebpo"})]},
        {"claim": "ref", "direction": 0, "plus": [("b", {"method": "ebpo", "group_size": 16})],
         "minus": [("b", {"method": "grpo", "group_size": 16})]},
        {"claim": "absent", "direction": 1, "plus": [("c", {"method": "ebpo"})],
         "minus": [("c", {"method": "grpo"})]},
    ]  # fmt: skip
    table = c.claims_table(claims, lambda p: parts.get(p, pd.DataFrame()))
    d_g2 = ebpo2 - grpo2
    d_shrink = (ebpo2[:4] - grpo2[:4]) - (ebpo16[:4] - grpo16[:4])
    row = table.set_index("claim")
    assert row.loc["g2", "diff"] == pytest.approx(d_g2.mean())
    assert row.loc["g2", "p"] == pytest.approx(stats.ttest_1samp(d_g2, 0).pvalue)
    assert row.loc["shrinks", "seeds"] == 4
    assert row.loc["shrinks", "diff"] == pytest.approx(d_shrink.mean())
    assert row.loc["shrinks", "p"] == pytest.approx(stats.ttest_1samp(d_shrink, 0).pvalue)
    # "absent" has a direction: it stays in Holm's family (3), never rejected.
    holm = power.holm([row.loc["g2", "p"], row.loc["shrinks", "p"], np.nan], 3)[:2]
    np.testing.assert_allclose(row.loc[["g2", "shrinks"], "p_holm"], holm)
    assert np.isnan(row.loc["ref", "p_holm"]) and row.loc["ref", "verdict"] == "n/a"
    assert row.loc["absent", "verdict"] == "not run" and row.loc["absent", "seeds"] == 0
    assert "| g2 |" in c.render(table)
    needed = dict(zip(table.claim, c.seeds_for(table, 0.02)))
    assert needed["g2"] == power.seeds_needed(0.02, d_g2.std(ddof=1)) and needed["absent"] == -1
    both = c.render(table, table[table.claim == "g2"], "other")
    assert "other: effect | other: seeds | other: verdict |" in both
    assert both.splitlines()[-1].endswith("| - | 0 | not run |")  # "absent" is not in `other`


def test_reasoning_claims_name_existing_parts_and_columns():
    c = _claims()
    module = c.load_module("configs/ablations/reasoning.py")
    columns = {"method", "group_size", "order", "block"}
    for claim in module.CLAIMS:
        assert claim["direction"] in (0, 1)
        for part, where in claim["plus"] + claim["minus"]:
            assert part in module.PARTS and set(where) <= columns, claim["claim"]


# The paper's headline Pass@1 (Qwen3-8B, average of 5 benchmarks; ../shared/PAPER.md).
PAPER_8B = {
    4: {"GRPO": 58.72, "Dr. GRPO": 56.67, "DAPO": 52.63, "EBPO": 64.39},
    8: {"GRPO": 54.26, "DAPO": 46.69, "EBPO": 65.54},
    16: {"GRPO": 63.16, "DAPO": 56.36, "EBPO": 64.64},
}


def test_the_paper_column_is_ebpo_minus_the_baseline_in_the_papers_table():
    c = _claims()
    numbers = c.load_module(c.PAPER_NUMBERS)
    gain = lambda g, base: PAPER_8B[g]["EBPO"] - PAPER_8B[g][base]
    first = lambda text: float(text.split()[0])
    for g in (4, 8, 16):
        assert first(numbers.number(f"EBPO beats GRPO at G={g}")) == round(gain(g, "GRPO"), 2)
    assert first(numbers.number("best rate: EBPO beats Dr. GRPO at G=4")) == round(
        gain(4, "Dr. GRPO"), 2
    )
    assert first(numbers.number("EBPO beats DAPO at G=4")) == round(gain(4, "DAPO"), 2)
    shrink = numbers.number("the gain shrinks with G: (EBPO - GRPO at G=4) - (at G=16)")
    assert first(shrink) == round(gain(4, "GRPO") - gain(16, "GRPO"), 2)
    for g in (8, 16):  # the paper has no G=2: its G=4 stands in, and says so
        text = numbers.number(f"the gain shrinks with G: (EBPO - GRPO at G=2) - (at G={g})")
        assert first(text) == round(gain(4, "GRPO") - gain(g, "GRPO"), 2) and "no G=2" in text
    assert numbers.number("across warm starts: EBPO beats GRPO at G=8") == "+11.28"
    assert numbers.number("reference: Clip-Cov - GRPO at G=4") == "-"
    finals = _finals({("grpo", 8): [0.1, 0.2], ("ebpo", 8): [0.2, 0.4]})
    claim = {"claim": "EBPO beats GRPO at G=8", "direction": 1,
             "plus": [("a", {"method": "ebpo"})], "minus": [("a", {"method": "grpo"})]}  # fmt: skip
    text = c.render(c.claims_table([claim], lambda p: finals), paper=["+11.28"])
    assert "| claim | paper (points) |" in text and "| EBPO beats GRPO at G=8 | +11.28 |" in text
    assert "paper (points)" not in c.render(c.claims_table([claim], lambda p: finals), paper=["-"])


def test_a_term_with_two_runs_per_seed_is_an_error():
    c = _claims()
    finals = _finals({("grpo", 4): [0.1, 0.2], ("ebpo", 4): [0.2, 0.3]})
    twice = pd.concat([finals, finals.assign(block="dapo")], ignore_index=True)
    claim = {"claim": "x", "direction": 1, "plus": [("a", {"method": "ebpo"})],
             "minus": [("a", {"method": "grpo"})]}  # fmt: skip
    with pytest.raises(
        ValueError, match=r"\('a', \{'method': 'ebpo'\}\) matches 4 runs for 2 seeds"
    ):
        c.claims_table([claim], lambda p: twice)


def test_arithmetic_claims_read_the_committed_grids():
    """Each claim of the arithmetic column finds the 3 paired seeds of the committed grids."""
    c = _claims()
    module = c.load_module("configs/ablations/arithmetic_claims.py")
    table = c.claims_table(module.CLAIMS, c.results_loader(module)).set_index("claim")
    assert (table.seeds == 3).all(), table.seeds
    reasoning = c.load_module("configs/ablations/reasoning.py")
    assert set(table.index) <= {claim["claim"] for claim in reasoning.CLAIMS}
    assert table.loc["EBPO beats GRPO at G=4", "diff"] == pytest.approx(0.026, abs=5e-4)


def test_held_columns_floor_bootstrap_and_mark_changes():
    """Per-problem outputs of two methods x 3 warm starts x 2 seeds x 2 rates: the bootstrap
    reads each method at its best validation rate, its effect is the final pass@1 effect,
    and the held verdict reads the floored interval and the bootstrap together."""
    from ebpo_jax.ablation import twolevel

    c = _claims()
    rng = np.random.default_rng(5)
    probs, finals = [], []
    for w in range(3):
        for s in range(2):
            for m, best in (("ebpo", 1e-4), ("grpo", 1e-5)):
                for lr in (1e-5, 1e-4):
                    correct = rng.integers(0, 5, 12) + (m == "ebpo") * (rng.uniform() < 0.6)
                    correct = np.minimum(correct, 4)
                    cols = {"method": m, "lr": lr, "sft.seed": w, "seed": s}
                    probs += [{**cols, "set": "heldout", "problem_id": f"p{j}", "samples": 4,
                               "correct": k} for j, k in enumerate(correct)]  # fmt: skip
                    probs += [{**cols, "set": "validation", "problem_id": "v0", "samples": 4,
                               "correct": 0}]  # fmt: skip
                    finals.append({**cols, "pass@1": correct.mean() / 4,
                                   "val_pass@1": 0.5 if lr == best else 0.1})  # fmt: skip
    probs, finals = pd.DataFrame(probs), pd.DataFrame(finals)
    claim = {"claim": "x", "direction": 1, "plus": [("p", {"method": "ebpo"})],
             "minus": [("p", {"method": "grpo"})], "select": {"axis": "lr", "by": "val_pass@1"}}  # fmt: skip
    d = c.problem_differences(claim, lambda p: probs, lambda p: finals)
    rate = lambda m, lr, w, s: probs[(probs.method == m) & (probs.lr == lr) & (probs["sft.seed"] == w)
                                     & (probs.seed == s) & (probs.set == "heldout")].correct / 4  # fmt: skip
    want = rate("ebpo", 1e-4, 2, 1).to_numpy() - rate("grpo", 1e-5, 2, 1).to_numpy()
    np.testing.assert_allclose(d.loc[(2, 1)][[f"p{j}" for j in range(12)]].to_numpy(), want)
    assert d.shape == (6, 12)
    row = c.claims_table([claim], lambda p: finals, problems_of=lambda p: probs).iloc[0]
    assert row.boot_diff == pytest.approx(row["diff"])  # pass@1 is the mean over problems
    boot = twolevel.bootstrap(d.to_numpy(), d.index.get_level_values(0))
    assert (row.boot_ci_low, row.boot_ci_high) == pytest.approx((boot["ci_low"], boot["ci_high"]))
    floored = twolevel.floored(d.to_numpy().mean(1), d.index.get_level_values(0))
    assert row.held_ci_low == pytest.approx(floored["ci_low"])
    lo, hi = min(floored["ci_low"], boot["ci_low"]), max(floored["ci_high"], boot["ci_high"])
    assert row.held_verdict == power.verdict(lo, hi, 1)
    text = c.render(c.claims_table([claim], lambda p: finals, problems_of=lambda p: probs))
    assert "| held: effect [95% interval] |" in text and "bootstrap over problems" in text


def test_changed_names_the_verdicts_that_moved():
    c = _claims()
    row = pd.Series({"verdict": "reproduced", "held_verdict": "inconclusive",
                     "verdict_holm": "inconclusive", "held_verdict_holm": "inconclusive"})  # fmt: skip
    assert c._change(row) == "reproduced -> inconclusive"
    assert c._change(row.replace("reproduced", "inconclusive")) == "-"
