"""One evaluator for every task family: sample held-out prompts, score them, pass@1 per set;
the last call's per-problem counts go to `eval_problems.csv.gz` (write_per_problem)."""

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from ebpo_jax import sampler
from ebpo_jax.evaluation import policy as policy_eval
from ebpo_jax.runtime.metrics import PER_PROBLEM_FILE
from ebpo_jax.spec import EvalSpec


class EvalSet(NamedTuple):
    """A held-out benchmark: right-padded prompts and a scorer of their k samples each."""

    name: str
    prompt_tokens: np.ndarray  # [n, T]
    prompt_lengths: np.ndarray  # [n]
    # (tokens [n*k, N], lengths [n*k]) host arrays, prompt-major -> correct [n*k] in [0, 1]
    score: Callable[[np.ndarray, np.ndarray], np.ndarray]
    key_stride: int = 1  # chunk i samples with fold_in(key(seed), i * key_stride)
    # Per problem (id, topic, difficulty), for the per-problem record; () = not recorded.
    problems: tuple = ()
    # Per problem, a band label (e.g. a difficulty quartile): each band's pass@1 is reported
    # as "<name>/<band>" from the same samples; () = none.
    bands: tuple = ()


def make_evaluator(
    spec: EvalSpec, model_config, sets: Sequence[EvalSet], stop_ids, mesh=None
) -> Callable[[Any], dict[str, float]] | None:
    """evaluate(params) -> {set name: pass@1}: the mean score over `spec.run.eval_samples` samples per
    problem at `spec.run.eval_temperature` (0 = greedy, one sample); the same draws at every call;
    a set with bands adds {"<set>/<band>": pass@1} (a view, not a set: tasks.protocol.mean_pass).
    `evaluate.per_problem` holds the last call's {set name: correct samples [n]};
    `evaluate(params, matrix=True)` returns {set name: scores [problems, samples]} instead of
    the means (experiments/eval.py's pass@k). None when there is no set."""
    if not sets:
        return None
    k = spec.samples_per_problem
    per_problem: dict[str, np.ndarray] = {}
    sampler_spec = sampler.SamplerSpec(
        max_new_tokens=spec.max_new_tokens,
        num_samples=k,
        eos_ids=() if stop_ids is None else stop_ids,
        sampling=sampler.Sampling(spec.run.eval_temperature),
    )

    def evaluate(params, *, matrix: bool = False) -> dict[str, Any]:
        out = {}
        for s in sets:
            tokens, lengths = policy_eval.sample_chunks(
                model_config,
                params,
                s.prompt_tokens,
                s.prompt_lengths,
                sampler_spec,
                policy_eval.Chunks(spec.run.eval_batch_size, spec.run.seed, s.key_stride),
                mesh=mesh,
            )
            correct = np.asarray(s.score(tokens, lengths), np.float64)  # prompt-major [n*k]
            out[s.name] = correct.reshape(-1, k) if matrix else float(correct.mean())
            per_problem[s.name] = correct.reshape(len(s.prompt_lengths), -1).sum(axis=1)
            if s.bands and not matrix:
                out.update(band_means(s, per_problem[s.name] / k))
        return out

    evaluate.per_problem = per_problem
    evaluate.sets = tuple(sets)
    evaluate.samples = k
    return evaluate


def band_means(s: EvalSet, rate_n: np.ndarray) -> dict[str, float]:
    """{"<set>/<band>": mean pass rate of the set's problems in that band}, bands sorted."""
    bands = np.asarray(s.bands)
    return {f"{s.name}/{b}": float(rate_n[bands == b].mean()) for b in sorted(set(s.bands))}


def write_per_problem(evaluate, workdir: str) -> str | None:
    """The last evaluation per problem (set, problem_id, topic, difficulty, samples, correct,
    and band where a set has bands) as `<workdir>/eval_problems.csv.gz`; None when no set
    records its problems."""
    rows, sets = [], getattr(evaluate, "sets", ())
    for s in sets:
        correct = evaluate.per_problem.get(s.name)
        if not s.problems or correct is None:
            continue
        bands = s.bands or ("",) * len(s.problems)
        for (pid, topic, difficulty), c, b in zip(s.problems, correct, bands):
            rows.append((s.name, pid, topic, difficulty, evaluate.samples, c, b))
    if not rows:
        return None
    cols = ["set", "problem_id", "topic", "difficulty", "samples", "correct", "band"]
    path = os.path.join(workdir, PER_PROBLEM_FILE)
    df = pd.DataFrame(rows, columns=cols).astype({"correct": float})
    if not any(s.bands for s in sets):  # the columns of every run before bands existed
        df = df.drop(columns="band")
    df.to_csv(path, index=False, compression={"method": "gzip", "mtime": 0})
    return path
