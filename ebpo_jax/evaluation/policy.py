"""Sample k responses per math record with a policy and score them: benchmarks and pass-rate difficulty.

Composes the sampler (model side), `data` (prompts), `rewards` (host verification) and
`evaluation` (metrics); used by experiments/eval.py and experiments/estimate_difficulty.py.
"""

import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from ebpo_jax import evaluation, rewards, sampler
from ebpo_jax.data import Record, decode_completions, encode_prompts, render_prompt
from ebpo_jax.runtime import distributed

# End-of-turn tokens of common chat templates, stopped on besides the tokenizer's EOS.
_STOP_TOKENS = ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", "<|end_of_text|>")


def stop_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS id plus the end-of-turn ids its vocabulary has."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in _STOP_TOKENS if t in vocab}
    ids.discard(None)
    if not ids:
        raise ValueError("tokenizer has no EOS token: generation would never stop")
    return sorted(ids)


def check_policy_paths(model_path: str, checkpoint: str | None = None) -> None:
    """FileNotFoundError (one line) unless the model folder and the trainer workdir exist.

    Checked before anything is loaded: opening a checkpoint manager on a mistyped workdir
    would create its folders.
    """
    from ebpo_jax.runtime.checkpoint import list_steps

    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"--model={model_path}: not a local HF folder (no config.json)")
    if checkpoint is not None:
        steps = list_steps(os.path.join(checkpoint, "checkpoints"))
        if not steps:
            raise FileNotFoundError(
                f"--checkpoint={checkpoint}: not a trainer workdir (no step in "
                f"{os.path.join(checkpoint, 'checkpoints')})"
            )


def load_policy(model_path: str, *, checkpoint: str | None = None, dtype=None):
    """(model_config, params, tokenizer) of a local HF folder; params from a trainer workdir's
    latest checkpoint instead when `checkpoint` is given (same architecture and tokenizer; a
    LoRA run's adapters merged into the folder's weights)."""
    from ebpo_jax import models
    from ebpo_jax.data import load_tokenizer

    check_policy_paths(model_path, checkpoint)
    model_config, params = models.from_hf(model_path, dtype=dtype)
    if checkpoint:  # a LoRA run's adapters are merged into the model_path base
        from ebpo_jax.models.lora_checkpoint import policy_of_run

        params = policy_of_run(checkpoint, params, model_config)
    return model_config, params, load_tokenizer(model_path)


class Chunks(NamedTuple):
    """How `sample_chunks` splits the prompts: `batch_size` at a time, chunk i sampling with
    fold_in(key(seed), i * key_stride)."""

    batch_size: int
    seed: int
    key_stride: int = 1


def sample_chunks(
    model_config,
    params,
    tokens_BT,
    lengths_B,
    spec: sampler.SamplerSpec,
    chunks: Chunks,
    *,
    mesh=None,
):
    """(tokens [n*k, N], lengths [n*k]) host arrays: k = spec.num_samples samples of each of n
    prompts.

    The first rows are repeated so every chunk has one shape (one compile); each chunk's key
    (`chunks`) gives the same draws at every call; row r inside a chunk is fold_in(., r)
    already (sampler).
    """
    seed, key_stride = chunks.seed, chunks.key_stride
    n, bs = len(lengths_B), min(chunks.batch_size, len(lengths_B))
    pad = (-n) % bs
    tokens_BT = np.concatenate([tokens_BT, tokens_BT[:pad]])
    lengths_B = np.concatenate([lengths_B, lengths_B[:pad]])
    out_t, out_l = [], []
    for i, s in enumerate(range(0, n + pad, bs)):
        gen = sampler.generate(
            model_config,
            params,
            tokens_BT[s : s + bs],
            lengths_B[s : s + bs],
            spec,
            rng=jax.random.fold_in(jax.random.key(seed), i * key_stride),
            mesh=mesh,
        )
        t, l = distributed.to_host((gen.tokens, gen.lengths))
        out_t.append(np.asarray(t))
        out_l.append(np.asarray(l))
    keep = n * spec.num_samples
    return np.concatenate(out_t)[:keep], np.concatenate(out_l)[:keep]


class ResponseSpec(NamedTuple):
    """How `sample_responses` renders, encodes and samples records (k = num_samples each)."""

    num_samples: int
    max_new_tokens: int
    max_prompt_len: int  # a longer prompt raises
    batch_size: int = 32
    template: str = "answer"
    chat: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def sample_responses(
    model_config, params, tokenizer: Any, records: Sequence[Record], spec: ResponseSpec, mesh=None
) -> list[list[str]]:
    """responses[i][j]: sample j for records[i]. A prompt over `spec.max_prompt_len` raises."""
    texts = [
        render_prompt(tokenizer, r.prompt, template=spec.template, chat=spec.chat) for r in records
    ]
    enc = encode_prompts(tokenizer, texts, max_length=spec.max_prompt_len, on_overflow="error")
    sampler_spec = sampler.SamplerSpec(
        max_new_tokens=spec.max_new_tokens,
        num_samples=spec.num_samples,
        eos_ids=stop_ids(tokenizer),
        sampling=sampler.Sampling(spec.temperature, spec.top_k, spec.top_p),
    )
    tokens, lengths = sample_chunks(
        model_config,
        params,
        enc.tokens,
        enc.lengths,
        sampler_spec,
        # chunk i folds in its first row's index
        Chunks(spec.batch_size, spec.seed, key_stride=min(spec.batch_size, len(records))),
        mesh=mesh,
    )
    decoded = decode_completions(tokenizer, tokens, lengths)
    k = spec.num_samples
    return [decoded[i : i + k] for i in range(0, len(decoded), k)]


class Scoring(NamedTuple):
    """How responses are scored: reward `reward` (ebpo_jax.rewards) in `workers` processes
    (None: the shared pool's default), each item cut at `timeout_s` (scores 0)."""

    reward: str = "math"
    timeout_s: float = 10.0
    workers: int | None = None


def score_responses(
    records: Sequence[Record], responses: Sequence[Sequence[str]], scoring: Scoring = Scoring()
) -> tuple[np.ndarray, list[list[str | None]], np.ndarray]:
    """(correct [num_records, k] bool, normalised extracted answers, correct for maj@k).

    The verifier may accept two samples with the same extracted answer differently (e.g. one
    timed out); for maj@k, samples with one answer share one verdict: correct if any is.
    """
    if len(records) != len(responses):
        raise ValueError(f"{len(records)} records but {len(responses)} response lists")
    k = len(responses[0])
    flat = [r for rs in responses for r in rs]
    if len(flat) != k * len(records):
        raise ValueError("every record needs the same number of responses")
    answers = [rec.answer for rec in records for _ in range(k)]
    reward_B = rewards.math_rewards(
        flat, answers, timeout_s=scoring.timeout_s, workers=scoring.workers, reward=scoring.reward
    )
    correct_PK = reward_B.reshape(len(records), k) > 0.5
    norm = [rewards.extract_answer(r[-rewards.MAX_RESPONSE_CHARS :]) for r in flat]
    norm = [None if a is None else rewards.normalize_answer(a) for a in norm]
    answers_PK = [norm[p * k : (p + 1) * k] for p in range(len(records))]
    verdict = {}
    for b, a in enumerate(norm):
        if a is not None:
            verdict[b // k, a] = verdict.get((b // k, a), False) or bool(correct_PK.flat[b])
    maj_PK = correct_PK.copy()
    for b, a in enumerate(norm):
        if a is not None:
            maj_PK.flat[b] = verdict[b // k, a]
    return correct_PK, answers_PK, maj_PK


def evaluate_benchmark(
    records: Sequence[Record],
    responses: Sequence[Sequence[str]],
    *,
    scoring: Scoring = Scoring(),
    ks: Sequence[int] | None = None,
    num_resamples: int = 1000,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """mean@k, pass@k and maj@k, each {"value", "lo", "hi"} (bootstrap 95%), of one benchmark."""
    correct_PK, answers_PK, maj_PK = score_responses(records, responses, scoring)
    out = evaluation.summarize(correct_PK, ks=ks, num_resamples=num_resamples, seed=seed)
    n = correct_PK.shape[1]
    for k in ks or evaluation.default_ks(n):
        v_P = evaluation.maj_at_k_per_problem(maj_PK, answers_PK, k)
        lo, hi = evaluation.bootstrap_interval(v_P, num_resamples=num_resamples, seed=seed)
        out[f"maj@{k}"] = {"value": float(v_P.mean()), "lo": lo, "hi": hi}
    return out
