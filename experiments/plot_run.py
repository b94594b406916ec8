"""Draw one run's curves: `python experiments/plot_run.py WORKDIR [--out=FILE.png]` (or `make plot`).

Reads `<WORKDIR>/metrics.jsonl` and writes a PNG (default `<WORKDIR>/curves.png`) with the
training reward, held-out pass@1, entropy, KL to the reference, response length and the share
of zero advantages against the step; prints the PNG's path. Works while the run trains. A
panel whose term the run's config.json turns off says so ("KL off (loss.kl_coef=0)") instead
of drawing the zeros logged for it.
"""

import argparse
import io
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # a file, no display (pods, CI, ssh)
import matplotlib.pyplot as plt

from ebpo_jax.runtime import metrics as metrics_lib
from ebpo_jax.runtime import storage
from ebpo_jax.runtime.shell import Shell

PANELS = (
    ("reward/mean", "training reward (mean)"),
    ("eval/pass@1", "held-out pass@1"),
    ("actor/entropy", "entropy (nats / token)"),
    ("actor/kl", "KL to the reference"),
    ("response_length/mean", "response length (tokens)"),
    ("adv/zero_frac", "zero-advantage share"),
)
# A panel's term and the setting that turns it on: at 0 the run logs zeros, not a measurement.
SWITCHES = {"actor/kl": ("KL", "loss.kl_coef")}


def run_config(workdir: str) -> dict:
    """The run's resolved config (`<workdir>/config.json`), {} when it has none."""
    path = os.path.join(workdir, "config.json")
    return json.loads(storage.read_text(path)) if storage.exists(path) else {}


def _setting(config: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            return None
        config = config[key]
    return config


def notes(rows: list[dict], config: dict) -> dict[str, str]:
    """The text a panel shows instead of a curve: its term is off, or it has no value yet."""
    out = {}
    for name, _ in PANELS:
        term, key = SWITCHES.get(name, (None, None))
        if key is not None and _setting(config, key) == 0:
            out[name] = f"{term} off ({key}=0)"
        elif not series(rows, name)[0]:
            out[name] = f"no {name} yet"
    return out


def series(rows: list[dict], name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have a finite `name`."""
    points = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot(rows: list[dict], out: str, title: str, config: dict | None = None) -> str:
    """Write the six panels of `rows` (metrics.jsonl records; `config`: the run's config.json)
    to `out`; returns `out`."""
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    texts = notes(rows, config or {})
    for ax, (name, label) in zip(axes.flat, PANELS):
        if name in texts:
            ax.text(0.5, 0.5, texts[name], ha="center", va="center", transform=ax.transAxes)
        else:
            marker = "o" if name.startswith("eval/") else None
            ax.plot(*series(rows, name), marker=marker, markersize=3, linewidth=1.2)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format="png")
    plt.close(fig)
    storage.write_bytes(out, buf.getvalue())  # a local file or a gs:// object
    return out


def main(argv=None) -> int:
    run_as = Shell.here().script("experiments/plot_run.py", "WORKDIR")
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"Run as: {run_as}",  # one line, unwrapped: a command to paste
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("workdir", help="a run's folder (the one holding metrics.jsonl)")
    parser.add_argument("--out", help="PNG path (default: WORKDIR/curves.png)")
    args = parser.parse_args(argv)
    path = os.path.join(args.workdir, metrics_lib.METRICS_FILE)
    if not (metrics_lib.has_metrics(args.workdir) or os.path.isfile(path)):
        print(f"error: {path} does not exist (not a run's workdir?)", file=sys.stderr)
        return 2
    rows = metrics_lib.read_metrics(path)
    if not rows:
        print(f"error: {path} has no rows yet", file=sys.stderr)
        return 2
    out = args.out or os.path.join(args.workdir, "curves.png")
    title = f"{storage.absolute(args.workdir)}: steps 0-{rows[-1]['step']}"
    print(plot(rows, out, title, run_config(args.workdir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
