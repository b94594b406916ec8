"""experiments/claims.py against an independent float64 reference, on synthetic grids shaped
like the paper-axes ones (results.csv eval rows, problems.csv.gz rows in shuffled order): the
registered claims of configs/ablations/paper_axes_claims.py and paper_curriculum_claims.py."""

import io
import math

import numpy as np
import pandas as pd
import pytest
from conftest import load_experiment
from scipy import stats

from ebpo_jax.ablation import registration, twolevel

J = 24  # held-out problems per run
SAMPLES = 4
SHA = "a" * 64


def _claims():
    return load_experiment("claims")


def _run(rng, cols: dict, effect: float, tokens: float, steps, val=None, bands=None):
    """(eval rows, problem rows) of one synthetic run: each held-out problem's correct count
    of SAMPLES, the last eval's pass@1 (and band means) their mean; earlier evals random."""
    base = np.linspace(0.05, 0.6, J)  # problem difficulty, shared by every run
    correct = rng.binomial(SAMPLES, np.clip(base + effect, 0, 1)).astype(float)
    ids = [f"test/t{j % 3}/1/{j}" for j in range(J)]
    probs = [{**cols, "set": "heldout", "problem_id": i, "samples": SAMPLES, "correct": k,
              **({"band": bands[j]} if bands else {})}
             for j, (i, k) in enumerate(zip(ids, correct))]  # fmt: skip
    # A validation row: it must never enter the bootstrap.
    probs.append({**cols, "set": "validation", "problem_id": "val/0", "samples": SAMPLES,
                  "correct": 0.0})  # fmt: skip
    evals = []
    for k, step in enumerate(steps):
        last = k == len(steps) - 1
        rate = correct / SAMPLES if last else rng.uniform(0, 0.6, J)
        row = {**cols, "step": step, "generated_tokens": tokens * step / steps[-1],
               "pass@1": rate.mean(), "claims_sha256": SHA}  # fmt: skip
        if bands:
            row.update({f"pass@1/{b}": rate[np.array(bands) == b].mean() for b in set(bands)})
        if val is not None:
            row["val_pass@1"] = val if last else 0.0
        evals.append(row)
    return evals, probs


def _frames(runs, rng, drop_problem=None):
    """results.csv and problems.csv.gz frames of `runs`, the problem rows shuffled, read back
    from CSV text as the loaders read them (rates like 2.3e-05 match by their text)."""
    evals = pd.DataFrame([r for e, _ in runs for r in e])
    probs = pd.DataFrame([r for _, p in runs for r in p])
    if drop_problem is not None:  # (run_id, problem_id) a run did not evaluate
        rid, pid = drop_problem
        probs = probs[~((probs.run_id == rid) & (probs.problem_id == pid))]
    probs = probs.sample(frac=1.0, random_state=int(rng.integers(1 << 30)))
    return tuple(pd.read_csv(io.StringIO(f.to_csv(index=False))) for f in (evals, probs))


def _g_axis(rng, missing=()):
    """4 warm starts x 2 seeds x (EBPO, GRPO, Clip-Cov) x G = 2, 4, 8, 16; runs in `missing`
    ((method, G, warm start, seed)) never finished."""
    runs, truth = [], {}
    gain = {"ebpo": 0.04, "grpo": 0.0, "clip_cov": 0.01}
    for w in (100, 101, 102, 103):
        warm = rng.normal(0, 0.02)
        for s in (0, 1):
            for m in gain:
                for g in (2, 4, 8, 16):
                    if (m, g, w, s) in missing:
                        continue
                    rid = f"g__sft.seed-{w}__seed-{s}__method-{m}__group_size-{g}"
                    cols = {"block": "g", "run_id": rid, "sft.seed": w, "seed": s, "method": m,
                            "group_size": g, "prompts_per_step": 16}  # fmt: skip
                    effect = gain[m] * 4 / g + warm * (m == "ebpo") + rng.normal(0, 0.01)
                    tokens = 1000.0 * g * (1.1 if m == "ebpo" else 1.0) * rng.uniform(0.9, 1.1)
                    runs.append(_run(rng, cols, effect, tokens, (0, 100, 200)))
                    truth[(m, g, w, s)] = runs[-1]
    return runs, truth


def _table(c, module, parts: dict) -> pd.DataFrame:
    """module's claims table over `parts` (part -> (results, problems)), indexed by claim."""
    rows_of = lambda p: parts.get(p, (pd.DataFrame(),))[0]
    problems_of = lambda p: parts.get(p, (None, pd.DataFrame()))[1]
    return c.claims_table(module.CLAIMS, rows_of, problems_of=problems_of).set_index("claim")


def _final(run) -> float:
    return run[0][-1]["pass@1"]


def _rates(run) -> dict:
    """problem_id -> pass rate of a run's held-out problems."""
    return {p["problem_id"]: p["correct"] / p["samples"] for p in run[1] if p["set"] == "heldout"}


def _ref_floored(d: dict) -> dict:
    """The registered interval from {(warm start, seed): difference}: the t over warm-start
    means with its standard error floored at sigma sqrt(sum 1 / n_w) / W."""
    ws = sorted({w for w, _ in d})
    groups = [np.array([v for (w, _), v in d.items() if w == x]) for x in ws]
    m = np.array([g.mean() for g in groups])
    big_w, mu = len(ws), float(np.mean([g.mean() for g in groups]))
    se = m.std(ddof=1) / math.sqrt(big_w)
    sigma2 = sum(((g - g.mean()) ** 2).sum() for g in groups) / (len(d) - big_w)
    floor = math.sqrt(sigma2 * sum(1 / len(g) for g in groups)) / big_w
    held, t = max(se, floor), stats.t.ppf(0.975, big_w - 1)
    p = 2 * stats.t.sf(abs(mu) / held, big_w - 1)
    return {"diff": mu, "ci_low": mu - t * held, "ci_high": mu + t * held, "p": p}


def _ref_boot(runs_by_key: dict, sign: dict) -> dict:
    """twolevel.bootstrap on a [pairs, problems] matrix built here by problem id: sum over a
    claim's terms of sign x each problem's pass rate (nan where a run lacks it)."""
    keys = sorted(runs_by_key)
    ids = sorted({i for runs in runs_by_key.values() for r in runs for i in _rates(r)})
    d_kj = np.zeros((len(keys), len(ids)))
    for k, key in enumerate(keys):
        for term, run in zip(sign[key], runs_by_key[key]):
            rates = _rates(run)
            d_kj[k] += [term * rates.get(i, np.nan) for i in ids]
    return twolevel.bootstrap(d_kj, [w for w, _ in keys])


def _holm_rejects(p: dict, family: int, alpha: float) -> set:
    """Holm's step-down procedure as stated: reject while the k-th smallest p <= alpha /
    (family - k); `family` counts hypotheses whose p is unknown (never rejected)."""
    out = set()
    for k, (name, value) in enumerate(sorted(p.items(), key=lambda kv: kv[1])):
        if value > alpha / (family - k):
            break
        out.add(name)
    return out


def _verdict(lo, hi, direction) -> str:
    if lo > 0 or hi < 0:
        return "reproduced" if (lo > 0) == (direction > 0) else "opposite"
    return "inconclusive"


def _gain(truth, key, g, other="grpo"):
    return _final(truth[("ebpo", g, *key)]) - _final(truth[(other, g, *key)])


def test_paper_axes_claims_equal_the_reference_with_a_missing_run_and_part():
    """The g_axis claims over 4 warm starts x 2 seeds, one GRPO G=4 run missing (its pair
    drops, no other shifts), the tuning part not run: effects, floored intervals, the
    bootstrap by problem id, the held verdicts and Holm over every directed claim."""
    c = _claims()
    module = c.load_module("configs/ablations/paper_axes_claims.py")
    rng = np.random.default_rng(0)
    runs, truth = _g_axis(rng, missing={("grpo", 4, 101, 1)})
    lacks = truth[("ebpo", 16, 102, 0)][0][-1]["run_id"], "test/t1/1/4"
    evals, probs = _frames(runs, rng, drop_problem=lacks)
    del truth[("ebpo", 16, 102, 0)][1][4]  # the reference's run lacks that problem too
    parts = {"g_axis": (evals, probs)}
    table = _table(c, module, parts)
    keys = [(w, s) for w in (100, 101, 102, 103) for s in (0, 1)]
    shrink = "the gain shrinks with G: (EBPO - GRPO at G=4) - (at G=16)"
    spec = {f"EBPO beats GRPO at G={g}": ([("ebpo", g)], [("grpo", g)]) for g in (2, 4, 8, 16)}
    spec[shrink] = ([("ebpo", 4), ("grpo", 16)], [("grpo", 4), ("ebpo", 16)])
    spec["EBPO beats Clip-Cov at G=4"] = ([("ebpo", 4)], [("clip_cov", 4)])
    for g in (2, 4, 8, 16):
        spec[f"reference: Clip-Cov - GRPO at G={g}"] = ([("clip_cov", g)], [("grpo", g)])
    held_p = {}
    for claim, (plus, minus) in spec.items():
        have = [k for k in keys if all((*t, *k) in truth for t in plus + minus)]
        d = {k: sum(_final(truth[(*t, *k)]) for t in plus)
             - sum(_final(truth[(*t, *k)]) for t in minus) for k in have}  # fmt: skip
        row, ref = table.loc[claim], _ref_floored(d)
        assert row.seeds == len(have) == (7 if ("grpo", 4) in plus + minus else 8), claim
        assert row["diff"] == pytest.approx(ref["diff"], abs=1e-12), claim
        for k in ("diff", "ci_low", "ci_high", "p"):
            assert row[f"held_{k}"] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), (claim, k)
        by_key = {k: [truth[(*t, *k)] for t in plus + minus] for k in have}
        boot = _ref_boot(by_key, {k: [1] * len(plus) + [-1] * len(minus) for k in have})
        for k in ("diff", "ci_low", "ci_high", "p"):
            assert row[f"boot_{k}"] == pytest.approx(boot[k], rel=1e-9, abs=1e-12), (claim, k)
        if row.direction:
            held_p[claim] = max(ref["p"], boot["p"])
            lo, hi = min(ref["ci_low"], boot["ci_low"]), max(ref["ci_high"], boot["ci_high"])
            assert row.held_verdict == _verdict(lo, hi, row.direction), claim
        else:
            assert row.held_verdict == "n/a" and np.isnan(row.held_p_holm), claim
    # The contrast's direction: EBPO minus GRPO, the synthetic gain positive at G=2.
    assert table.loc["EBPO beats GRPO at G=2", "diff"] > 0.03
    directed = [cl["claim"] for cl in module.CLAIMS if cl["direction"]]
    not_run = [cl for cl in directed if cl not in spec]
    assert len(directed) == 12 and len(not_run) == 6
    assert (table.loc[not_run, "held_verdict_holm"] == "not run").all()
    adjusted = table.held_p_holm.astype(float)
    for alpha in np.unique(np.r_[[p for p in held_p.values() if p < 1], 0.05, 0.2, 0.5]):
        rejected = set(table.index[adjusted <= alpha])  # the adjusted p is the smallest alpha
        assert rejected == _holm_rejects(held_p, len(directed), alpha), alpha
    ranked = adjusted[list(held_p)].to_numpy()[np.argsort(list(held_p.values()))]
    assert (np.diff(ranked) >= 0).all() and ranked.max() <= 1.0  # monotone, capped at 1


def test_holm_family_counts_claims_not_run_and_the_table_says_so():
    """A directed claim whose runs are missing stays in Holm's family (its p unknown, never
    rejected), so a family read part-way is the registered one; the text states it."""
    c = _claims()
    finals = pd.DataFrame({"method": ["ebpo"] * 4 + ["grpo"] * 4, "seed": [0, 1, 2, 3] * 2,
                           "pass@1": [0.30, 0.31, 0.29, 0.33, 0.20, 0.22, 0.21, 0.20]})  # fmt: skip
    vs = lambda name, part, d=1: {"claim": name, "direction": d,
                                  "plus": [(part, {"method": "ebpo"})],
                                  "minus": [(part, {"method": "grpo"})]}  # fmt: skip
    claims = [vs("ran", "a"), vs("absent", "b"), vs("absent too", "b"), vs("ref", "b", 0)]
    table = c.claims_table(claims, lambda p: finals if p == "a" else pd.DataFrame())
    p = table.p.iloc[0]
    assert table.p_holm.iloc[0] == pytest.approx(min(1.0, 3 * p))  # m = 3, not 1
    assert table.held_p_holm.iloc[0] == pytest.approx(min(1.0, 3 * table.held_p.iloc[0]))
    assert list(table.verdict_holm[1:3]) == ["not run"] * 2
    assert c.holm_family(table) == (
        "Holm family: the 3 claims with a direction, 2 of them not run (in the family with "
        "an unknown p, never rejected, so the family does not shrink with the runs read).\n"
    )


LRS = (1e-5, 2.3e-5, 5.5e-5, 1.3e-4, 3e-4)
# Each method's best rate on validation: GRPO's and DAPO's at the grid's ends.
PEAK = {"ebpo": 5.5e-5, "grpo": 1e-5, "dr_grpo": 2.3e-5, "rloo": 1.3e-4, "rpp": 5.5e-5,
        "clip_cov": 2.3e-5, "dapo": 3e-4}  # fmt: skip


def _tuning(rng, missing=()):
    """3 warm starts x 2 seeds x 7 methods x 5 rates at G=4; EBPO and DAPO evaluated every
    10 steps, the others every 50; DAPO generates ~3x the tokens."""
    runs, truth = [], {}
    for w in (200, 201, 202):
        for s in (0, 1):
            for m, peak in PEAK.items():
                for lr in LRS:
                    if (m, lr, w, s) in missing:
                        continue
                    dense = m in ("ebpo", "dapo")
                    cols = {"block": "dense" if dense else "lr", "sft.seed": w, "seed": s,
                            "method": m, "lr": lr, "group_size": 4, "prompts_per_step": 32,
                            "run_id": f"{'dense' if dense else 'lr'}__{w}_{s}_{m}_{lr}"}  # fmt: skip
                    val = 0.3 - 0.02 * abs(np.log(lr / peak)) + rng.normal(0, 1e-3)
                    tokens = 1e5 * (3.0 if m == "dapo" else 1.0) * rng.uniform(0.95, 1.05)
                    steps = tuple(range(0, 201, 10 if dense else 50))
                    effect = 0.03 * (m == "ebpo") + rng.normal(0, 0.01)
                    runs.append(_run(rng, cols, effect, tokens, steps, val=val))
                    truth[(m, lr, w, s)] = runs[-1]
    return runs, truth


def _interp(run, budget: float, column: str = "pass@1", until: int = 10**9) -> float:
    """`column` at `budget` generated tokens, linear between the run's eval rows up to step
    `until` (by hand)."""
    rows = [r for r in run[0] if r["step"] <= until]
    for a, b in zip(rows, rows[1:]):
        t0, t1 = a["generated_tokens"], b["generated_tokens"]
        if t0 <= budget <= t1:
            return a[column] + (budget - t0) / (t1 - t0) * (b[column] - a[column])
    raise AssertionError(budget)


def test_best_rate_claims_pair_at_each_methods_rate_and_flag_the_grids_ends():
    """Each method read at its own best validation rate (mean over its runs), compared on the
    test split paired by (warm start, seed); a best rate at 1e-5 or 3e-4 reported as not
    bracketed; equal tokens two-level and floored, read from the eval rows' token counts."""
    c = _claims()
    module = c.load_module("configs/ablations/paper_axes_claims.py")
    rng = np.random.default_rng(1)
    runs, truth = _tuning(rng, missing={("grpo", 1e-5, 201, 0)})
    evals, probs = _frames(runs, rng)
    parts = {"tuning": (evals, probs)}
    table = _table(c, module, parts)
    best = {}
    for m in PEAK:
        vals = {lr: np.mean([r[0][-1]["val_pass@1"] for (m2, lr2, _, _), r in truth.items()
                             if (m2, lr2) == (m, lr)]) for lr in LRS}  # fmt: skip
        best[m] = max(vals, key=vals.get)
    assert best == PEAK
    keys = [(w, s) for w in (200, 201, 202) for s in (0, 1)]
    for other in ("grpo", "dr_grpo", "rloo", "rpp", "clip_cov", "dapo"):
        claim = next(cl for cl in module.CLAIMS if cl.get("select") and
                     cl["minus"][0][1]["method"] == other)  # fmt: skip
        row = table.loc[claim["claim"]]
        pair = {k: (truth[("ebpo", best["ebpo"], *k)], truth[(other, best[other], *k)])
                for k in keys if (other, best[other], *k) in truth}  # fmt: skip
        assert row.seeds == len(pair) == (5 if other == "grpo" else 6), other
        ref = _ref_floored({k: _final(a) - _final(b) for k, (a, b) in pair.items()})
        for k in ("diff", "ci_low", "ci_high", "p"):
            assert row[f"held_{k}"] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), (other, k)
        boot = _ref_boot({k: list(v) for k, v in pair.items()}, {k: [1, -1] for k in pair})
        assert row.boot_ci_low == pytest.approx(boot["ci_low"], rel=1e-9), other
        edge = other in ("grpo", "dapo")
        assert row.best == f"ebpo {best['ebpo']:g}; {other} {best[other]:g}" + (
            " (not bracketed)" if edge else ""
        )
        tok, ratio = {}, []
        for k, (a, b) in pair.items():
            ends = a[0][-1]["generated_tokens"], b[0][-1]["generated_tokens"]
            tok[k] = _interp(a, min(ends)) - _interp(b, min(ends))
            ratio.append(max(ends) / min(ends))
        ref = _ref_floored(tok)
        for k in ("diff", "ci_low", "ci_high", "p"):
            assert row[f"tok_{k}"] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), (other, k)
        assert row.token_ratio == pytest.approx(np.mean(ratio))
    assert table.loc["best rate: EBPO beats DAPO at G=4", "token_ratio"] > 2.5
    text = c.render(table.reset_index())
    assert "| best rate (validation) |" in text and "dapo 0.0003 (not bracketed)" in text


def _curriculum(rng):
    """3 warm starts x 2 seeds x 3 orders, evaluated every 28 steps to 112; each warm start's
    held-out quartiles (its own difficulty file) a different split of the problems."""
    runs, truth, orders = [], {}, ("naive", "difficulty", "reverse_difficulty")
    for w in (300, 301, 302):
        bands = [f"q{1 + j % 4}" for j in rng.permutation(J)]
        for s in (0, 1):
            for order in orders:
                rid = f"epoch__sft.seed-{w}__seed-{s}__method-ebpo__order-{order}"
                cols = {"block": "epoch", "run_id": rid, "sft.seed": w, "seed": s,
                        "method": "ebpo", "order": order, "group_size": 4}  # fmt: skip
                effect = 0.02 * orders.index(order) + rng.normal(0, 0.01)
                tokens = 5e4 * (1 + 0.1 * orders.index(order)) * rng.uniform(0.95, 1.05)
                runs.append(_run(rng, cols, effect, tokens, (0, 28, 56, 84, 112), bands=bands))
                truth[(order, w, s)] = runs[-1]
    return runs, truth


def _at(run, step: int, column: str) -> float:
    return next(r[column] for r in run[0] if r["step"] == step)


def test_curriculum_band_and_step_claims_read_their_band_and_step():
    """Band claims read pass@1/<band> and bootstrap over each warm start's own band; a term's
    step reads that evaluation (no bootstrap: per-problem counts are the last step's)."""
    c = _claims()
    module = c.load_module("configs/ablations/paper_curriculum_claims.py")
    rng = np.random.default_rng(2)
    runs, truth = _curriculum(rng)
    evals, probs = _frames(runs, rng)
    table = _table(c, module, {"curriculum": (evals, probs)})
    keys = [(w, s) for w in (300, 301, 302) for s in (0, 1)]
    for claim in module.CLAIMS:
        band = claim.get("band")
        column = f"pass@1/{band}" if band else "pass@1"
        terms = [(sign, where["order"], where.get("step", 112)) for sign, side in
                 ((1, claim["plus"]), (-1, claim["minus"])) for _, where in side]  # fmt: skip
        d = {k: sum(sign * _at(truth[(o, *k)], step, column) for sign, o, step in terms)
             for k in keys}  # fmt: skip
        row, ref = table.loc[claim["claim"]], _ref_floored(d)
        for k in ("diff", "ci_low", "ci_high", "p"):
            assert row[f"held_{k}"] == pytest.approx(ref[k], rel=1e-9, abs=1e-12), claim["claim"]
        steps = {step for _, _, step in terms}
        if len(steps) == 1:  # equal tokens: every term's curve up to the claim's step
            at = lambda o, k, s=steps.pop(): [r for r in truth[(o, *k)][0] if r["step"] == s][0]
            tok = {}
            for k in keys:
                budget = min(at(o, k)["generated_tokens"] for _, o, _ in terms)
                tok[k] = sum(sign * _interp(truth[(o, *k)], budget, column, step)
                             for sign, o, step in terms)  # fmt: skip
            assert row.tok_diff == pytest.approx(_ref_floored(tok)["diff"]), claim["claim"]
            assert row.token_ratio > 1.05  # the orders' token counts differ: read at equal ones
        else:  # the claim compares budgets by design: no equal-token reading
            assert np.isnan(row.tok_diff) and np.isnan(row.token_ratio), claim["claim"]
        if any(step != 112 for _, _, step in terms):
            assert np.isnan(row.boot_diff), claim["claim"]
            continue
        in_band = lambda r: r if not band else (r[0], [p for p in r[1] if p.get("band") == band])
        by_key = {k: [in_band(truth[(o, *k)]) for _, o, _ in terms] for k in keys}
        boot = _ref_boot(by_key, {k: [sign for sign, _, _ in terms] for k in keys})
        for k in ("diff", "ci_low", "ci_high", "p"):
            assert row[f"boot_{k}"] == pytest.approx(boot[k], rel=1e-9, abs=1e-12), claim["claim"]
        assert row.boot_diff == pytest.approx(row.held_diff)  # pass@1 (band) is their mean
    assert table.boot_diff.notna().sum() == 5  # two epoch claims, q4, q1, hard-to-easy - naive


def test_registration_is_pre_registered_only_when_every_run_read_has_the_current_hash():
    """Every run a claim reads (a best-rate claim: every rate's) recorded the claims file's
    current SHA-256: pre-registered; another hash anywhere: post hoc; some without: partial;
    a term without runs: not run, like the claim's row."""
    c = _claims()
    module = c.load_module("configs/ablations/paper_axes_claims.py")
    sha = registration.file_sha256(module.__file__)
    rng = np.random.default_rng(3)
    g_axis = _frames(_g_axis(rng)[0], rng)[0].assign(claims_sha256=sha)
    tuning = _frames(_tuning(rng)[0], rng)[0].assign(claims_sha256=sha)
    g4, best = "EBPO beats GRPO at G=4", "best rate: EBPO beats GRPO at G=4"
    claims = [cl for cl in module.CLAIMS if cl["claim"] in (g4, best, "EBPO beats GRPO at G=2")]

    def labels(g_rows, t_rows):
        rows = {"g_axis": g_rows, "tuning": t_rows}
        return dict(zip([cl["claim"] for cl in claims], c.registrations(module, claims, rows.get)))

    assert set(labels(g_axis, tuning).values()) == {registration.PRE}
    # GRPO at G=4, one run's hash changed / one run's missing; GRPO at a rate not chosen.
    one = lambda rows, m, col, value: rows.index[(rows.method == m) & (rows[col] == value)][-1]
    other = g_axis.copy()
    other.loc[one(other, "grpo", "group_size", 4), "claims_sha256"] = "b" * 64
    partial = g_axis.copy()
    partial.loc[one(partial, "grpo", "group_size", 4), "claims_sha256"] = np.nan
    unchosen = tuning.copy()
    unchosen.loc[one(unchosen, "grpo", "lr", 3e-4), "claims_sha256"] = "b" * 64
    assert labels(other, tuning)[g4] == registration.POST_CHANGED
    assert labels(other, tuning)["EBPO beats GRPO at G=2"] == registration.PRE
    assert labels(partial, tuning)[g4] == registration.PARTIAL
    assert labels(g_axis, unchosen)[best] == registration.POST_CHANGED
    no_grpo = g_axis[g_axis.method != "grpo"]
    assert labels(no_grpo, pd.DataFrame())[g4] == labels(g_axis, pd.DataFrame())[best] == "not run"


def test_rerun_band_of_the_paper_rule_spans_the_cells_warm_starts():
    """The paper grids' rerun rule judges a run against the prediction band of its cell's 16
    runs (all warm starts): `cell_verdict`; `verdict` keeps the run's own warm start's band."""
    from ebpo_jax.ablation import rerun as rerun_lib
    from ebpo_jax.ablation.grid import Run

    rng = np.random.default_rng(4)
    recorded = _frames(_g_axis(rng)[0], rng)[0].assign(cpu="AMD EPYC 7B13")
    run = Run("g", (("sft.seed", 100), ("seed", 0), ("method", "ebpo"), ("group_size", 4)), ())
    old = recorded[recorded.run_id == run.run_id]
    finals = recorded[(recorded.step == 200) & (recorded.method == "ebpo")]
    cell = finals[finals.group_size == 4]["pass@1"].to_numpy()
    half = stats.t.ppf(0.975, 7) * cell.std(ddof=1) * math.sqrt(1 + 1 / 8)
    new = old.assign(**{"pass@1": old["pass@1"].where(old.step < 200, cell.mean() + 1.1 * half)})
    report = rerun_lib._rerun_report(
        recorded, old, new, run, {"cpu": "Intel(R) Xeon(R)"}, atol=0.0, warm_file=""
    )
    assert report["cell_band"]["seeds"] == 8 and report["seed_band"]["seeds"] == 2
    assert report["cell_band"]["high"] == pytest.approx(cell.mean() + half)
    assert report["cell_verdict"] == "other CPU family: outside the seed band"
    own = finals[(finals.group_size == 4) & (finals["sft.seed"] == 100)]["pass@1"].to_numpy()
    inside = abs(cell.mean() + 1.1 * half - own.mean()) <= (
        stats.t.ppf(0.975, 1) * own.std(ddof=1) * math.sqrt(1.5)
    )
    assert report["verdict"].endswith("inside the seed band" if inside else "outside the seed band")


def test_best_value_ties_are_named_and_the_table_says_which_columns_decide():
    c = _claims()
    finals = pd.DataFrame({"method": ["grpo"] * 6, "lr": [1e-5, 1e-5, 3e-5, 3e-5, 1e-4, 1e-4],
                           "seed": [0, 1] * 3, "val_pass@1": [0.3, 0.3, 0.2, 0.4, 0.1, 0.1]})  # fmt: skip
    claim = {"claim": "x", "direction": 1, "plus": [("p", {"method": "grpo"})], "minus": [],
             "select": {"axis": "lr", "by": "val_pass@1"}}  # fmt: skip
    # 3e-5's mean is 0.30000000000000004 by float rounding alone: a tie, the smallest taken.
    assert c.best_values(claim, lambda p: finals) == "grpo 1e-05 (not bracketed) (tied with 3e-05)"
    assert set(c.term(finals, {"method": "grpo"}, claim["select"], "val_pass@1")) == {0.3}
    by_order = finals.assign(order=finals.lr.map({1e-5: "a", 3e-5: "b", 1e-4: "c"}))
    claim["select"] = {"axis": "order", "by": "val_pass@1"}
    assert c.best_values(claim, lambda p: by_order) == "grpo a (tied with b)"
    paper = c.load_module("configs/ablations/paper_axes_claims.py")
    curriculum = c.load_module("configs/ablations/paper_curriculum_claims.py")
    robust = c.load_module("configs/ablations/robust_claims.py")
    for registered in (paper, curriculum):
        assert "Held columns (registered: the verdict rule above" in c.columns_text(registered)
    assert "Held columns (issue 49, added after these runs" in c.columns_text(robust)
