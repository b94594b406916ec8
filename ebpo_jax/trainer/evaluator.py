"""One evaluator for every task family: sample held-out prompts, score them, pass@1 per set."""

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ebpo_jax import policy_eval
from ebpo_jax.spec import EvalSpec


class EvalSet(NamedTuple):
    """A held-out benchmark: right-padded prompts and a scorer of their k samples each."""

    name: str
    prompt_tokens: np.ndarray  # [n, T]
    prompt_lengths: np.ndarray  # [n]
    # (tokens [n*k, N], lengths [n*k]) host arrays, prompt-major -> correct [n*k] in [0, 1]
    score: Callable[[np.ndarray, np.ndarray], np.ndarray]
    key_stride: int = 1  # chunk i samples with fold_in(key(seed), i * key_stride)


def make_evaluator(
    spec: EvalSpec, model_config, sets: Sequence[EvalSet], stop_ids, mesh=None
) -> Callable[[Any], dict[str, float]] | None:
    """evaluate(params) -> {set name: pass@1}: the mean score over `spec.samples` samples per
    problem at `spec.temperature` (0 = greedy, one sample); the same draws at every call.
    `evaluate(params, per_problem=True)` -> {set name: scores [problems, samples]} instead
    (experiments/eval.py's pass@k). None when there is no set."""
    if not sets:
        return None
    k = spec.samples_per_problem

    def evaluate(params, *, per_problem: bool = False) -> dict[str, Any]:
        out = {}
        for s in sets:
            tokens, lengths = policy_eval.sample_chunks(
                model_config,
                params,
                s.prompt_tokens,
                s.prompt_lengths,
                batch_size=spec.batch_size,
                num_samples=k,
                max_new_tokens=spec.max_new_tokens,
                seed=spec.seed,
                key_stride=s.key_stride,
                temperature=spec.temperature,
                eos_id=stop_ids,
                mesh=mesh,
            )
            scores = np.asarray(s.score(tokens, lengths), np.float64)  # prompt-major [n*k]
            out[s.name] = scores.reshape(-1, k) if per_problem else float(scores.mean())
        return out

    return evaluate
