"""The sampler's one entry: `generate`, a call of one `Session`, whose programs AOT compiles.

A Session plans a call (rows, slots and pages over the mesh) and runs the engine's programs:
prefill then decode, or, for multi-turn rows (`turns=True`), prefill and a first turn, then
each `resume` feeds given tokens and decodes on from the rows' kept pages.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import sharding
from ebpo_jax.models import moe
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
    data_axes=None, row_limits=None,
) -> Generation:  # fmt: skip
    """`spec.num_samples` completions per right-padded prompt, as a `Generation`.

    prompt_tokens [B, Tp] int, prompt_tokens[b, :prompt_lengths[b]] is prompt b. Rows of the
    output are prompt-major: prompt b's samples are rows b*G .. (b+1)*G - 1. Row r's token t
    is drawn with fold_in(fold_in(rng, r), t), so neither the slots, the pages nor the batch
    around a row change its tokens. With `mesh`, rows, slots and pages are split over
    `data_axes` (default: the rules' batch axes); params keep whatever sharding they have.
    The Generation carries the decode's Stats and, with spec.record_routing (mixture of
    experts), every input token's experts as compact ints for routing replay (a row's last
    token has zeros). row_limits: [rows] int, a token limit per row (<= max_new_tokens), as
    if each row's stop id came at that length.
    """
    session = Session(config, spec, mesh=mesh, data_axes=data_axes)
    return session.start(params, prompt_tokens, prompt_lengths, rng=rng, row_limits=row_limits)


class Session:
    """Rows of one sampler call and the engine programs that decode them.

    `start` prefills the prompts and decodes every row: the whole call (`generate`), or with
    `turns=True` every row's first turn, its KV pages kept. Each `resume` (turns only) feeds
    the given tokens (an environment's observations) through the decode steps, as a row's own
    tokens are, and decodes on, so nothing is prefilled twice; it returns every row's episode
    so far (given tokens with log-prob 0). Row r's token t is drawn with
    fold_in(fold_in(rng, r), t) over the whole episode. `programs` are, for a call's shapes,
    the engine programs `start` and `resume` run; `compile` lowers them on abstract inputs,
    as the ahead-of-time compiler (pods/aot.py) does.
    """

    def __init__(self, config, spec: SamplerSpec, *, mesh=None, data_axes=None, turns=False):
        self.config, self.spec = config, validated(spec, config.vocab_size)
        if self.spec.record_routing and not config.is_moe:
            raise ValueError("record_routing needs a mixture-of-experts config (num_experts > 0)")
        if self.spec.expert_parallel:
            self.config = moe.expert_parallel_config(config)
        self.mesh, self.data_axes, self.turns = mesh, data_axes, turns
        self.state, self.stats, self._run = None, None, None

    def programs(self, num_prompts: int, prompt_len: int) -> dict:
        """The engine's programs for num_prompts prompts of width prompt_len (name -> Program)."""
        plan = engine.make_plan(
            self.spec, num_prompts, prompt_len, self.mesh, self.data_axes,
            self.config.sharding_rules,
        )  # fmt: skip
        if self.turns:
            engine.check_turns(self.spec, plan)
        return engine.programs(engine.Call(self.config, self.spec, plan), self.turns)

    def start(self, params, prompt_tokens, prompt_lengths, *, rng, row_limits=None) -> Generation:
        """Every row's completion, or (turns) first turn, up to row_limits [rows] tokens."""
        with self._mesh_if_needed():
            return self._start(params, prompt_tokens, prompt_lengths, rng, row_limits)

    def _mesh_if_needed(self):
        """The mesh to trace under when none is set (abstract: a caller may be inside a jit):
        expert parallelism's shard_map needs it; without it the programs leave the layout to
        the compiler, as they always have."""
        ambient = jax.sharding.get_abstract_mesh()
        if not self.spec.expert_parallel or self.mesh is None or not ambient.empty:
            return contextlib.nullcontext()
        return jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh)

    def _start(self, params, prompt_tokens, prompt_lengths, rng, row_limits) -> Generation:
        spec = self.spec
        _check_prompts(self.config, prompt_tokens, prompt_lengths, spec.max_new_tokens)
        num_prompts, prompt_len = jnp.shape(prompt_tokens)
        rows = num_prompts * spec.num_samples
        if row_limits is not None and jnp.shape(row_limits) != (rows,):
            raise ValueError(f"row_limits must have shape ({rows},), got {jnp.shape(row_limits)}")
        if self.turns and row_limits is None:
            raise ValueError("a Session with turns=True needs row_limits")
        limit_R = None if row_limits is None else jnp.asarray(row_limits, jnp.int32)
        self._run = self.programs(num_prompts, prompt_len)
        self.rng, self.eos_E = rng, jnp.asarray(spec.eos_ids, jnp.int32).reshape(-1)
        lengths_P = jnp.asarray(prompt_lengths, jnp.int32)
        staged, first_R, logp_R, *prompt_routes = self._run["prefill"](
            params, jnp.asarray(prompt_tokens, jnp.int32), lengths_P, rng
        )
        prefilled = engine.Prefilled(staged, first_R, logp_R)
        if self.turns:
            self.state, self.stats = self._run["begin"](
                params, prefilled, lengths_P, rng, self.eos_E, limit_R
            )
            return self._episodes()
        gen, stats = self._run["decode"](params, prefilled, lengths_P, rng, self.eos_E, limit_R)
        if spec.record_routing:
            gen, comp_routes = gen
            gen = gen._replace(routing={"prompt": prompt_routes[0], "comp": comp_routes})
        return gen._replace(stats=stats)

    def resume(self, params, given_tokens, given_mask, go, row_limits) -> Generation:
        """Rows `go` [rows] continue up to token row_limits [rows] of their episode; where
        given_mask [rows, N] holds, given_tokens [rows, N] is fed instead of drawn."""
        if self.state is None:
            raise ValueError("Session.resume before start (and a Session needs turns=True)")
        given = engine.Given(
            jnp.asarray(go, bool), jnp.asarray(row_limits, jnp.int32),
            jnp.asarray(given_tokens, jnp.int32), jnp.asarray(given_mask, bool),
        )  # fmt: skip
        with self._mesh_if_needed():
            self.state, self.stats = self._run["resume"](
                params, self.state, self.rng, self.eos_E, given
            )
        return self._episodes()

    def _episodes(self) -> Generation:
        gen = engine.turns_generation(self.state, self._run["prefill"].call)
        return gen._replace(stats=self.stats)

    def compile(
        self, params, num_prompts: int, prompt_len: int, *, lower_only=False, compile_fn=None
    ) -> dict:
        """The programs of a call on abstract inputs (`params`: ShapeDtypeStructs with their
        shardings), each traced, lowered and compiled (by `compile_fn(lowered)`, default
        `lowered.compile()`) in the order a call runs them: name -> (Traced, Lowered, Compiled
        or None with lower_only). "plan" -> the call's Plan."""
        programs = self.programs(num_prompts, prompt_len)
        plan = programs["prefill"].call.plan
        rng, prompt_PT, lengths_P, eos_E = _abstract_call(
            self.spec, plan, self.mesh, num_prompts, prompt_len
        )
        per_row = lambda shape, dtype: jax.ShapeDtypeStruct(
            shape, dtype, sharding=lengths_P.sharding
        )
        rows, N = num_prompts * self.spec.num_samples, self.spec.max_new_tokens
        limit_R = per_row((rows,), np.int32)
        out = {"plan": plan}

        def build(name, *args):
            traced = programs[name].trace(*args)
            lowered = traced.lower()
            compiled = None if lower_only else (compile_fn or type(lowered).compile)(lowered)
            out[name] = (traced, lowered, compiled)
            return sharding.abstract_outputs(traced, compiled)

        with _on(self.mesh):
            prefilled = engine.Prefilled(*build("prefill", params, prompt_PT, lengths_P, rng)[:3])
            if not self.turns:
                build("decode", params, prefilled, lengths_P, rng, eos_E, None)  # as generate
                return out
            turns = build("begin", params, prefilled, lengths_P, rng, eos_E, limit_R)[0]
            given = engine.Given(
                per_row((rows,), bool), limit_R, per_row((rows, N), np.int32),
                per_row((rows, N), bool),
            )  # fmt: skip
            build("resume", params, turns, rng, eos_E, given)
        return out


def _on(mesh):
    """jax.set_mesh(mesh), or nothing without a mesh."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def _abstract_call(spec: SamplerSpec, plan, mesh, num_prompts: int, prompt_len: int):
    """Abstract (rng, prompts, lengths, stop ids) of a call: prompts split as the plan says."""
    rep = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    prompt_sh = plan.prompt_lead or rep
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    prompt_PT = jax.ShapeDtypeStruct((num_prompts, prompt_len), np.int32, sharding=prompt_sh)
    lengths_P = jax.ShapeDtypeStruct((num_prompts,), np.int32, sharding=prompt_sh)
    eos_E = jax.ShapeDtypeStruct((len(spec.eos_ids),), np.int32, sharding=rep)
    return rng, prompt_PT, lengths_P, eos_E
