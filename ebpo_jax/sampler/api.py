"""`generate`: checks a call's inputs, plans it, runs the engine's prefill then its decode."""

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax.sampler import engine
from ebpo_jax.sampler.spec import Generation, SamplerSpec, validated


def _check_prompts(config, prompt_tokens, prompt_lengths, max_new_tokens):
    """Shapes and dtypes, and (when concrete) the lengths and ids, with one-line errors."""
    if jnp.ndim(prompt_tokens) != 2:
        raise ValueError(f"prompt_tokens must be [B, Tp], got shape {jnp.shape(prompt_tokens)}")
    batch, prompt_len = jnp.shape(prompt_tokens)
    if jnp.shape(prompt_lengths) != (batch,):
        raise ValueError(
            f"prompt_lengths must have shape ({batch},) to match prompt_tokens "
            f"{jnp.shape(prompt_tokens)}, got {jnp.shape(prompt_lengths)}"
        )
    for name, x in (("prompt_tokens", prompt_tokens), ("prompt_lengths", prompt_lengths)):
        if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise ValueError(f"{name} must be integer, got {jnp.result_type(x)}")
    if isinstance(prompt_lengths, jax.core.Tracer) or isinstance(prompt_tokens, jax.core.Tracer):
        return
    lengths = np.asarray(prompt_lengths)
    if lengths.size and (lengths.min() < 1 or lengths.max() > prompt_len):
        raise ValueError(
            f"prompt_lengths must lie in [1, {prompt_len}] (the prompt_tokens width), "
            f"got min {lengths.min()} max {lengths.max()}"
        )
    if lengths.size and lengths.max() + max_new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"longest prompt {lengths.max()} + max_new_tokens {max_new_tokens} exceeds "
            f"config.max_position_embeddings {config.max_position_embeddings}"
        )
    tokens = np.asarray(prompt_tokens)
    real = np.arange(prompt_len)[None] < lengths[:, None]
    if np.any(real & ((tokens < 0) | (tokens >= config.vocab_size))):
        raise ValueError(f"prompt_tokens hold ids outside the vocabulary [0, {config.vocab_size})")


def generate(
    config, params, prompt_tokens, prompt_lengths, spec: SamplerSpec, *, rng, mesh=None,
    data_axes=None,
) -> Generation:  # fmt: skip
    """`spec.num_samples` completions per right-padded prompt, as a `Generation`.

    prompt_tokens [B, Tp] int, prompt_tokens[b, :prompt_lengths[b]] is prompt b. Rows of the
    output are prompt-major: prompt b's samples are rows b*G .. (b+1)*G - 1. Row r's token t
    is drawn with fold_in(fold_in(rng, r), t), so neither the slots, the pages nor the batch
    around a row change its tokens. With `mesh`, rows, slots and pages are split over
    `data_axes` (default: the rules' batch axes); params keep whatever sharding they have.
    spec.record_routing (mixture of experts): returns (Generation, routing) with routing =
    {"prompt": [rows, sparse layers, Tp, k], "comp": [rows, sparse layers, N, k]}, every input
    token's experts as compact ints, for routing replay (a row's last token has zeros).
    """
    return generate_with_stats(
        config, params, prompt_tokens, prompt_lengths, spec, rng=rng, mesh=mesh,
        data_axes=data_axes,
    )[0]  # fmt: skip


def generate_with_stats(
    config, params, prompt_tokens, prompt_lengths, spec: SamplerSpec, *, rng, mesh=None,
    data_axes=None, row_limits=None,
) -> tuple[Generation, engine.Stats]:  # fmt: skip
    """generate, and the decode's Stats (steps, busy and computed slot-steps, preemptions,
    peak pages).

    row_limits: [rows] int, a token limit per row (<= max_new_tokens), as if each row's
    stop id came at that length: how benchmarks impose a length distribution.
    """
    spec = validated(spec, config.vocab_size)
    if spec.record_routing and not config.is_moe:
        raise ValueError("record_routing needs a mixture-of-experts config (num_experts > 0)")
    _check_prompts(config, prompt_tokens, prompt_lengths, spec.max_new_tokens)
    num_prompts, prompt_len = jnp.shape(prompt_tokens)
    rows = num_prompts * spec.num_samples
    if row_limits is not None and jnp.shape(row_limits) != (rows,):
        raise ValueError(f"row_limits must have shape ({rows},), got {jnp.shape(row_limits)}")
    limit_R = None if row_limits is None else jnp.asarray(row_limits, jnp.int32)
    plan = engine.make_plan(spec, num_prompts, prompt_len, mesh, data_axes, config.sharding_rules)
    prompt_PT = jnp.asarray(prompt_tokens, jnp.int32)
    lengths_P = jnp.asarray(prompt_lengths, jnp.int32)
    eos_E = jnp.asarray(spec.eos_ids, jnp.int32).reshape(-1)
    static = {"config": config, "spec": spec, "plan": plan}
    staged, first_R, logp_R, *prompt_routes = engine.prefill_jit(
        params, prompt_PT, lengths_P, rng, **static
    )
    prefilled = engine.Prefilled(staged, first_R, logp_R)
    gen, stats = engine.decode_jit(params, prefilled, lengths_P, rng, eos_E, limit_R, **static)
    if spec.record_routing:
        gen, comp_routes = gen
        gen = (gen, {"prompt": prompt_routes[0], "comp": comp_routes})
    return gen, stats


class TurnSession:
    """Rows decoded over several calls with their KV pages kept (multi-turn episodes).

    `start` prefills the prompts and runs every row's first turn; each `resume` feeds the
    given tokens (an environment's observations) through the decode steps, as a row's own
    tokens are, and decodes on, so nothing is prefilled twice. Both return every row's
    episode so far as a Generation (given tokens with log-prob 0). Row r's token t is drawn
    with fold_in(fold_in(rng, r), t) over the whole episode, as `generate` draws it.
    """

    def __init__(self, config, spec: SamplerSpec, *, mesh=None, data_axes=None):
        self.config, self.spec = config, validated(spec, config.vocab_size)
        self.mesh, self.data_axes = mesh, data_axes
        self.state, self.static, self.stats = None, None, None

    def start(self, params, prompt_tokens, prompt_lengths, row_limits, *, rng) -> Generation:
        """Every row's first turn, up to row_limits [rows] tokens."""
        spec = self.spec
        _check_prompts(self.config, prompt_tokens, prompt_lengths, spec.max_new_tokens)
        num_prompts, prompt_len = jnp.shape(prompt_tokens)
        plan = engine.make_plan(
            spec, num_prompts, prompt_len, self.mesh, self.data_axes, self.config.sharding_rules
        )
        engine.check_turns(spec, plan)
        self.static = {"config": self.config, "spec": spec, "plan": plan}
        self.rng, self.eos_E = rng, jnp.asarray(spec.eos_ids, jnp.int32).reshape(-1)
        lengths_P = jnp.asarray(prompt_lengths, jnp.int32)
        prefilled = engine.Prefilled(
            *engine.prefill_jit(
                params, jnp.asarray(prompt_tokens, jnp.int32), lengths_P, rng, **self.static
            )
        )
        limit_R = jnp.asarray(row_limits, jnp.int32)
        self.state, self.stats = engine.begin_turns_jit(
            params, prefilled, lengths_P, rng, self.eos_E, limit_R, **self.static
        )
        return engine.turns_generation(self.state, spec=spec, plan=plan)

    def resume(self, params, given_tokens, given_mask, go, row_limits) -> Generation:
        """Rows `go` [rows] continue up to token row_limits [rows] of their episode; where
        given_mask [rows, N] holds, given_tokens [rows, N] is fed instead of drawn."""
        if self.state is None:
            raise ValueError("TurnSession.resume before start")
        given = engine.Given(
            jnp.asarray(go, bool), jnp.asarray(row_limits, jnp.int32),
            jnp.asarray(given_tokens, jnp.int32), jnp.asarray(given_mask, bool),
        )  # fmt: skip
        self.state, self.stats = engine.continue_turns_jit(
            params, self.state, self.rng, self.eos_E, given, **self.static
        )
        return engine.turns_generation(self.state, spec=self.spec, plan=self.static["plan"])
