"""Evaluation metrics over a [num_problems, n] correctness matrix: mean@k, unbiased pass@k, maj@k.

Each metric has a per-problem form (a vector over problems) so `bootstrap_interval` can
resample problems; the benchmark score is the mean of that vector.
"""

from collections import Counter
from collections.abc import Sequence

import numpy as np


def _check_correct(correct_PN) -> np.ndarray:
    c = np.asarray(correct_PN)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(
            f"expected a non-empty [num_problems, n] correctness matrix, got {c.shape}"
        )
    return c.astype(np.float64)


def _check_k(k: int, n: int) -> None:
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")


def pass_at_k_per_problem(correct_PN, k: int) -> np.ndarray:
    """Unbiased pass@k per problem (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), c correct of n."""
    c_PN = _check_correct(correct_PN)
    n = c_PN.shape[1]
    _check_k(k, n)
    c_P = np.rint(c_PN.sum(1)).astype(np.int64)
    # C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i): a product of at most n terms, no overflow.
    i_N = np.arange(1, n + 1, dtype=np.float64)
    factors_PN = np.where(i_N[None, :] > (n - c_P)[:, None], 1.0 - k / i_N[None, :], 1.0)
    return 1.0 - np.prod(factors_PN, axis=1)


def mean_at_k_per_problem(correct_PN) -> np.ndarray:
    """Average pass@1 per problem over its n samples (the paper's "mean@k")."""
    return _check_correct(correct_PN).mean(1)


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent non-None answer; ties go to the one seen first. None if there is none."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def maj_at_k_per_problem(
    correct_PN, answers_PN: Sequence[Sequence[str | None]], k: int
) -> np.ndarray:
    """maj@k per problem: 1 if a sample carrying the majority of the first k answers is correct.

    `answers_PN[p][j]` is sample j's extracted, normalised answer (None if none was found);
    samples with equal answers must agree on correctness, which is checked.
    """
    c_PN = _check_correct(correct_PN)
    P, n = c_PN.shape
    _check_k(k, n)
    if len(answers_PN) != P or any(len(a) != n for a in answers_PN):
        raise ValueError(f"answers must be [num_problems={P}, n={n}] like the correctness matrix")
    out = np.zeros(P)
    for p in range(P):
        first = list(answers_PN[p][:k])
        verdicts = {}
        for a, c in zip(first, c_PN[p, :k]):
            if a is not None and verdicts.setdefault(a, c) != c:
                raise ValueError(f"problem {p}: answer {a!r} is marked both correct and wrong")
        winner = majority_answer(first)
        out[p] = 0.0 if winner is None else verdicts[winner]
    return out


def bootstrap_interval(
    values_P, *, num_resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of mean(values_P), resampling problems with replacement."""
    v = np.asarray(values_P, np.float64)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"expected a non-empty vector of per-problem values, got {v.shape}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    idx_RP = np.random.default_rng(seed).integers(0, v.size, size=(num_resamples, v.size))
    means_R = v[idx_RP].mean(1)
    tail = (1.0 - confidence) / 2
    lo, hi = np.quantile(means_R, [tail, 1.0 - tail])
    return float(lo), float(hi)


def default_ks(n: int) -> list[int]:
    """The powers of two up to n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i <= n} | {n})


def summarize(
    correct_PN,
    answers_PN: Sequence[Sequence[str | None]] | None = None,
    *,
    ks: Sequence[int] | None = None,
    num_resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """{"mean@n", "pass@k" for k in ks, "maj@k" (if answers)}: each {"value", "lo", "hi"} (0-1 scale).

    `ks` defaults to the powers of two up to n, and n itself.
    """
    c_PN = _check_correct(correct_PN)
    n = c_PN.shape[1]
    ks = default_ks(n) if ks is None else ks
    per_problem = {f"mean@{n}": mean_at_k_per_problem(c_PN)}
    for k in ks:
        per_problem[f"pass@{k}"] = pass_at_k_per_problem(c_PN, k)
    if answers_PN is not None:
        for k in ks:
            per_problem[f"maj@{k}"] = maj_at_k_per_problem(c_PN, answers_PN, k)
    out = {}
    for name, v_P in per_problem.items():
        lo, hi = bootstrap_interval(
            v_P, num_resamples=num_resamples, confidence=confidence, seed=seed
        )
        out[name] = {"value": float(v_P.mean()), "lo": lo, "hi": hi}
    return out


def format_table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """A benchmark x metric table of percentages with intervals, for printing."""
    metrics = sorted(
        {m for r in results.values() for m in r},
        key=lambda m: (m.split("@")[0], int(m.split("@")[1])),
    )
    rows = [["benchmark", *metrics]]
    for bench, r in results.items():
        cells = [
            f"{100 * r[m]['value']:.2f} [{100 * r[m]['lo']:.1f}, {100 * r[m]['hi']:.1f}]"
            if m in r
            else "-"
            for m in metrics
        ]
        rows.append([bench, *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)
