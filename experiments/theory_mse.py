"""Monte-Carlo MSE of EBPO's shrunk baseline vs the group mean, with the closed forms overlaid.

python experiments/theory_mse.py [--out=results/theory] [--trials=1000] [--group_sizes=2,4,8,16,32]
Prompts have pass rates p ~ Beta(alpha, beta) and G Bernoulli(p) rewards each. Per G, the
library's EBState is warmed on `--warm_batches` batches of the same population, then each
trial draws a fresh batch, merges it (as a training step does) and reads the shrunk
baseline from `eb_diagnostics`. Writes theory_mse.csv and theory_mse.png to --out.
"""

import argparse
import csv
import os
import sys

import jax
import numpy as np

from ebpo_jax.advantages import eb_diagnostics, init_eb_state, merge_batch


def population(alpha: float, beta: float) -> dict:
    """Closed-form moments of p ~ Beta(alpha, beta): mean, tau2 = Var(p), sigma2 = E[p(1-p)]."""
    mu = alpha / (alpha + beta)
    tau2 = mu * (1 - mu) / (alpha + beta + 1)
    return {"mu": mu, "tau2": tau2, "sigma2": mu * (1 - mu) - tau2}


def closed_form(alpha: float, beta: float, g: int) -> dict:
    """Theory at group size g: the oracle S, both MSEs, and the zero-signal shares."""
    pop = population(alpha, beta)
    noise = pop["sigma2"] / g
    shrink = noise / (noise + pop["tau2"])
    k = np.arange(g)
    all_pass = float(np.prod((alpha + k) / (alpha + beta + k)))  # E[p^G]
    all_fail = float(np.prod((beta + k) / (alpha + beta + k)))  # E[(1-p)^G]
    return {
        "S_oracle": shrink,
        "mse_group_closed": noise,
        "mse_eb_closed": (1 - shrink) * noise,
        "all_fail_closed": all_fail,
        "zero_signal_closed": all_fail + all_pass,
    }


def _draw(rng, alpha, beta, shape, g):
    """Pass rates `shape` ~ Beta(alpha, beta) and G Bernoulli rewards for each."""
    # numpy, not jax.random.beta: that one costs ~5 s of compile per shape on CPU.
    p = rng.beta(alpha, beta, shape)
    return p.astype(np.float32), (rng.random((*shape, g)) < p[..., None]).astype(np.float32)


@jax.jit
def _trials(rewards_WPG, p_NP, rewards_NPG):
    """Warms an EBState on W batches, then per trial merges its batch and reads the baseline."""
    warm, _ = jax.lax.scan(
        lambda st, r_PG: (merge_batch(st, r_PG), None), init_eb_state(), rewards_WPG
    )

    def trial(p_P, r_PG):
        diag = eb_diagnostics(r_PG, merge_batch(warm, r_PG))
        constant_P = (r_PG == r_PG[:, :1]).all(-1)
        return {
            "mse_eb": ((diag["baseline"] - p_P) ** 2).mean(),
            "mse_group": ((diag["group_mean"] - p_P) ** 2).mean(),
            "shrinkage": diag["shrinkage"].mean(),
            "mu_glob": diag["mu_glob"][0],
            "zero_signal": constant_P.mean(),
            "all_fail": (constant_P & (r_PG[:, 0] == 0)).mean(),
        }

    return jax.vmap(trial)(p_NP, rewards_NPG)


def simulate(rng, alpha, beta, prompts, g, trials, warm_batches) -> dict:
    """Per-trial MSEs of both baselines, the library's shrinkage and mu_glob, zero-signal shares."""
    _, rewards_WPG = _draw(rng, alpha, beta, (warm_batches, prompts), g)
    p_NP, rewards_NPG = _draw(rng, alpha, beta, (trials, prompts), g)
    stats = _trials(rewards_WPG, p_NP, rewards_NPG)
    return {name: np.asarray(x, np.float64) for name, x in stats.items()}


def _mean_se(x):
    return float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size))


def summarise(alpha, beta, g, sims: dict) -> dict:
    """One CSV row: empirical means with standard errors over trials next to the closed forms."""
    pop = population(alpha, beta)
    row = {"G": g, "trials": sims["mse_eb"].size, **closed_form(alpha, beta, g)}
    for name in ("mse_group", "mse_eb", "zero_signal", "all_fail"):
        row[name], row[name + "_se"] = _mean_se(sims[name])
    row["ratio"] = row["mse_eb"] / row["mse_group"]
    row["ratio_se"] = _mean_se(sims["mse_eb"] / sims["mse_group"])[1]
    # The library estimates sigma2 and tau2 from rewards (PAPER.md), so its S is not the
    # oracle S; the exact MSE of a baseline shrunk with weight S toward mu_glob is below.
    s, bias2 = sims["shrinkage"], (sims["mu_glob"] - pop["mu"]) ** 2
    row["S_library"] = float(s.mean())
    row["mse_eb_plugin"] = float(
        ((1 - s) ** 2 * pop["sigma2"] / g + s**2 * (pop["tau2"] + bias2)).mean()
    )
    return row


def plot(rows, path, title=""):
    """Three panels vs G: both MSEs (log-log), their ratio, and the share of zero-signal groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    g = np.array([r["G"] for r in rows])
    col = lambda name: np.array([r[name] for r in rows])
    fig, (ax_mse, ax_ratio, ax_zero) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_mse.plot(g, col("mse_group_closed"), "C0-", label=r"closed form $\sigma^2/G$")
    ax_mse.plot(g, col("mse_eb_closed"), "C1-", label=r"closed form $(1-S)\,\sigma^2/G$")
    ax_mse.plot(g, col("mse_eb_plugin"), "C1:", label="closed form, library's S")
    ax_mse.errorbar(g, col("mse_group"), 2 * col("mse_group_se"), fmt="C0o", label="group mean")
    ax_mse.errorbar(g, col("mse_eb"), 2 * col("mse_eb_se"), fmt="C1s", label="EB baseline")
    ax_mse.set(xscale="log", yscale="log", xlabel="group size G", ylabel="MSE vs true p")
    ax_mse.set_title("baseline MSE (bars: 2 s.e. over trials)")
    group_closed = col("mse_group_closed")
    ax_ratio.plot(g, col("mse_eb_closed") / group_closed, "C1-", label="closed form $1-S$")
    ax_ratio.plot(g, col("mse_eb_plugin") / group_closed, "C1:", label="closed form, library's S")
    ax_ratio.errorbar(g, col("ratio"), 2 * col("ratio_se"), fmt="C1s", label="empirical")
    ax_ratio.set(xscale="log", xlabel="group size G", ylabel="MSE(EB) / MSE(group mean)")
    ax_ratio.set_title("EB gain over the group mean")
    ax_zero.plot(g, col("zero_signal_closed"), "C2-", label=r"closed $E[(1-p)^G + p^G]$")
    ax_zero.plot(g, col("all_fail_closed"), "C3-", label=r"closed $E[(1-p)^G]$")
    ax_zero.errorbar(g, col("zero_signal"), 2 * col("zero_signal_se"), fmt="C2o", label="all equal")
    ax_zero.errorbar(g, col("all_fail"), 2 * col("all_fail_se"), fmt="C3s", label="all fail")
    ax_zero.set(xscale="log", ylim=(0, 1), xlabel="group size G", ylabel="share of groups")
    ax_zero.set_title("groups with zero GRPO signal")
    for ax in (ax_mse, ax_ratio, ax_zero):
        ax.set_xticks(g, [str(x) for x in g])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="results/theory", help="Output folder.")
    ap.add_argument("--trials", type=int, default=1000, help="Independent batches per G.")
    ap.add_argument("--group_sizes", default="2,4,8,16,32", help="Comma-separated G values.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=512, help="Prompts per batch (paper: 512).")
    ap.add_argument("--warm_batches", type=int, default=100, help="Batches merged before trials.")
    ap.add_argument("--alpha", type=float, default=0.6, help="Beta prior of pass rates: alpha.")
    ap.add_argument("--beta", type=float, default=1.4, help="Beta prior of pass rates: beta.")
    args = ap.parse_args(argv)
    try:
        args.group_sizes = [int(x) for x in args.group_sizes.split(",")]
    except ValueError:
        ap.error(f"--group_sizes must be comma-separated integers, got {args.group_sizes!r}")
    if min(args.group_sizes) < 2:
        ap.error(f"--group_sizes must all be >= 2, got {args.group_sizes}")
    for name in ("trials", "prompts", "warm_batches"):
        if getattr(args, name) < (2 if name == "trials" else 1):
            ap.error(f"--{name} is too small: {getattr(args, name)}")
    if args.alpha <= 0 or args.beta <= 0:
        ap.error(f"--alpha and --beta must be > 0, got {args.alpha}, {args.beta}")
    return args


_COLUMNS = (
    "G", "trials", "mse_group", "mse_group_se", "mse_group_closed", "mse_eb", "mse_eb_se",
    "mse_eb_closed", "mse_eb_plugin", "ratio", "ratio_se", "S_oracle", "S_library",
    "zero_signal", "zero_signal_se", "zero_signal_closed", "all_fail", "all_fail_se",
    "all_fail_closed",
)  # fmt: skip


def main(argv=None) -> list[dict]:
    """Runs the simulation, writes the CSV and PNG, prints the table; returns the rows."""
    args = _parse(argv)
    pop = population(args.alpha, args.beta)
    rng = np.random.default_rng(args.seed)
    rows = [
        summarise(
            args.alpha,
            args.beta,
            g,
            simulate(rng, args.alpha, args.beta, args.prompts, g, args.trials, args.warm_batches),
        )
        for g in args.group_sizes
    ]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "theory_mse.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(
            {k: f"{v:.6g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows
        )
    setup = (
        f"p ~ Beta({args.alpha}, {args.beta}): mean {pop['mu']:.3f}, tau2 = Var(p) = "
        f"{pop['tau2']:.4f}, sigma2 = E[p(1-p)] = {pop['sigma2']:.4f}; {args.trials} trials "
        f"x {args.prompts} prompts per G, EB state warmed on {args.warm_batches} batches"
    )
    plot(rows, os.path.join(args.out, "theory_mse.png"), setup)
    print(setup)
    print(
        f"{'G':>3} {'MSE group':>16} {'sigma2/G':>9} {'MSE EB':>16} {'(1-S)s2/G':>9} "
        f"{'lib-S form':>10} {'ratio':>6} {'S orac':>6} {'S lib':>6} {'zero sig':>14} {'closed':>6}"
    )
    for r in rows:
        print(
            f"{r['G']:>3} {r['mse_group']:.5f}±{r['mse_group_se']:.5f} "
            f"{r['mse_group_closed']:>9.5f} {r['mse_eb']:.5f}±{r['mse_eb_se']:.5f} "
            f"{r['mse_eb_closed']:>9.5f} {r['mse_eb_plugin']:>10.5f} {r['ratio']:>6.3f} "
            f"{r['S_oracle']:>6.3f} {r['S_library']:>6.3f} "
            f"{r['zero_signal']:.4f}±{r['zero_signal_se']:.4f} {r['zero_signal_closed']:>6.4f}"
        )
    print(f"wrote {args.out}/theory_mse.csv and theory_mse.png")
    return rows


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    main(sys.argv[1:])
