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
    holm = power.holm([row.loc["g2", "p"], row.loc["shrinks", "p"]])
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
