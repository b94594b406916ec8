"""The sampling engine: one jitted prefill, one jitted decode loop over a paged KV cache.

Prefill runs each prompt once (models.prefill: splash / cuDNN / XLA attention) and keeps its
keys and values as pages. The decode loop runs `slots` rows at a time per data shard; each
step feeds every live row its last token, writes its key/value into its own page, attends
over its own pages (sampler.attention), samples, then frees the pages of rows that ended,
gives growing rows their next page and refills free slots (sampler.schedule). With a slot
per row it is the static batch. With spec.live_buckets > 1 a step computes only its live
slots, packed into the smallest of a few fixed batch sizes. Row r's token t is drawn with fold_in(fold_in(rng, r), t),
so a row's tokens do not depend on the slots, the pages or the rows around it.

Multi-turn rows (begin_turns, continue_turns) run the same loop on the static batch with
reserved pages, and keep its state (`Turns`) between calls: a continued row is fed the tokens
it is given (an environment's observation) as if it had drawn them, then draws on.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import models
from ebpo_jax.sampler import attention, layout, pages, schedule, selection
from ebpo_jax.sampler.spec import PAD_ID, Generation, SamplerSpec


class Plan(NamedTuple):
    """The static shape of a call: per data shard D, its rows, slots, prompts and pages."""

    shards: int  # D
    rows: int  # per shard
    slots: int
    prompts: int  # prompts a shard's rows come from
    pages: int  # pool pages per shard
    width: int  # pages of the prompt width
    max_pages: int  # page-table columns: a row's longest cache
    impl: str  # paged decode attention
    reserve: bool  # the pool holds every slot's longest row: rows take all their pages at once
    lead: object  # NamedSharding of axis 0 over the data axes, or None
    prompt_lead: object  # the same for the prefill's prompts (None if they do not split)


class Stats(NamedTuple):
    """Decode steps, slot-steps that decoded a live row or were computed, preemptions, most
    pages held. busy and computed are summed over the shards."""

    steps: jax.Array
    busy: jax.Array
    computed: jax.Array  # busy or idle; steps x slots x shards with live_buckets = 1
    preempted: jax.Array
    peak_pages: jax.Array  # per shard, the largest over shards
    slots: int  # per shard
    pages: int  # per shard


def make_plan(spec: SamplerSpec, num_prompts, prompt_len, mesh=None, axes=None, rules=None):
    """The Plan of a call, after one-line checks that rows, slots and pages fit the shards."""
    D = layout.data_size(mesh, axes, rules, spec.dp_attention)
    G, N, ps = spec.num_samples, spec.max_new_tokens, spec.page_size
    R = num_prompts * G
    if R % D:
        raise ValueError(f"{R} rows (prompts x num_samples) cannot be split over {D} data shards")
    slots = R if spec.slots == 0 or spec.slots >= R else spec.slots
    if slots % D:
        raise ValueError(f"slots={spec.slots} must be a multiple of the {D} data shards")
    width = pages.pages_for(prompt_len, ps)
    max_pages = max(pages.pages_for(prompt_len + N - 1, ps), width)
    total = spec.kv_pages or slots * max_pages
    if total % D:
        raise ValueError(f"kv_pages={spec.kv_pages} must be a multiple of the {D} data shards")
    if total // D < max_pages:
        raise ValueError(
            f"kv_pages={spec.kv_pages} gives {total // D} pages per data shard, but one row "
            f"(prompt width {prompt_len} + max_new_tokens {N} - 1 tokens) needs {max_pages} "
            f"pages of page_size {ps}"
        )
    Rd = R // D
    first = [d * Rd // G for d in range(D)]
    prompts = max(((d + 1) * Rd - 1) // G - first[d] + 1 for d in range(D))
    lead = layout.leading_sharding(mesh, axes, rules, spec.dp_attention)
    prompt_lead = lead if num_prompts % D == 0 else None
    impl = attention.resolve(spec.attention, _platform(mesh))
    reserve = spec.kv_pages == 0
    return Plan(
        D, Rd, slots // D, prompts, total // D, width, max_pages, impl, reserve, lead, prompt_lead
    )


class Call(NamedTuple):
    """A call's static description, hashable: a jitted program's one static argument."""

    config: object  # the model's config
    spec: SamplerSpec
    plan: Plan

    def with_slots(self, slots: int) -> "Call":
        """The same call on `slots` slots per shard (a live bucket)."""
        return self._replace(plan=self.plan._replace(slots=slots))


def _platform(mesh):
    if mesh is None:
        return None
    platform = mesh.devices.flat[0].platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def _shard_prompts(plan: Plan, num_samples: int):
    """[D, Q] global prompt of each shard's local prompt, [D, R] local prompt of each row."""
    D, Rd, G = plan.shards, plan.rows, num_samples
    row_DR = np.arange(D * Rd).reshape(D, Rd)
    first_D = row_DR[:, 0] // G
    prompt_DQ = np.minimum(first_D[:, None] + np.arange(plan.prompts)[None], (D * Rd - 1) // G)
    return prompt_DQ, row_DR // G - first_D[:, None]


def prefill(params, prompt_PT, lengths_P, rng, *, call: Call):
    """Each prompt once: its pages per layer [D, Q, W, page_size, 2K, Dh] and every row's token 0.

    spec.record_routing: a fourth output, each row's prompt experts [rows, sparse layers, Tp, k].
    """
    config, spec, plan = call
    Tp, G = prompt_PT.shape[1], spec.num_samples
    mask_PT = jnp.arange(Tp)[None] < lengths_P[:, None]
    # Padding ids are arbitrary; an out-of-vocabulary one would put NaN in masked cache slots.
    prompt_PT = jnp.where(mask_PT, prompt_PT, PAD_ID)
    last_PV, cache, *route = models.prefill(
        config,
        params,
        prompt_PT,
        mask=mask_PT,
        cache_size=Tp,
        logits_at=lengths_P - 1,
        with_router=spec.record_routing,
    )
    prompt_DQ, _ = _shard_prompts(plan, G)
    D, Q = prompt_DQ.shape

    def stage(k_PKTd, v_PKTd):
        kv = pages.prompt_pages(k_PKTd, v_PKTd, spec.page_size)
        if D * Q == kv.shape[0] and (prompt_DQ.reshape(-1) == np.arange(D * Q)).all():
            kv = kv.reshape(D, Q, *kv.shape[1:])  # each shard's prompts are its own: no gather
        else:
            kv = kv[prompt_DQ]
        return layout.constrain(kv, plan.lead)

    staged = tuple(map(stage, cache["k"], cache["v"]))
    last_RV = jnp.repeat(last_PV, G, axis=0)
    s = spec.sampling
    first_R, logp_R = selection.select_tokens(
        selection.row_keys(rng, jnp.arange(last_RV.shape[0]), 0),
        last_RV,
        **s._asdict(),
        invariant=config.batch_invariant,
    )
    if spec.record_routing:
        prompt_routes = jnp.repeat(route[0]["experts"].transpose(1, 0, 2, 3), G, axis=0)
        return staged, first_R, logp_R, prompt_routes
    return staged, first_R, logp_R


def _copy_prompts(pools, staged, copy: schedule.Copy, serial: bool = True):
    """Admitted rows' pages filled from their prompt's pages (one shard, every layer).

    serial: the layers go one after another. Each gathers its rows' prompt pages (as large
    as the prompts) before writing them, and XLA:TPU otherwise gathered every layer's first
    and held them all at once, a pool-sized temporary when every row is admitted together.
    Off on CPU, where memory is not the limit and the ordering cost time.
    """

    def layer(pool_PSCD, kv_QWSCD):
        W = kv_QWSCD.shape[1]
        pool_PSCD = pages.write_pages(pool_PSCD, kv_QWSCD[copy.prompt_C], copy.shared_CW)
        partial_C = jnp.minimum(copy.partial_C, W - 1)
        src_C1SCD = kv_QWSCD[copy.prompt_C, partial_C][:, None]
        return pages.write_pages(pool_PSCD, src_C1SCD, copy.own_C[:, None])

    done = []
    for pool_PSCD, kv_QWSCD in zip(pools, staged):
        if serial and done:  # this layer's gather waits for the previous layer's writes
            pool_PSCD, kv_QWSCD, _ = jax.lax.optimization_barrier((pool_PSCD, kv_QWSCD, done[-1]))
        done.append(layer(pool_PSCD, kv_QWSCD))
    return tuple(done)


def _admit(st, pools, staged, rows, *, plan, page_size):
    """admit on every shard; the page copies only on steps that admit a row."""
    admit = functools.partial(schedule.admit, page_size=page_size, reserve=plan.reserve)
    st, copy = jax.vmap(admit)(st, rows)
    admitted = jnp.any(copy.own_C < plan.pages)
    serial = not layout.on_cpu(plan.lead)
    copy_all = lambda _, p: jax.vmap(functools.partial(_copy_prompts, serial=serial))(
        p, staged, copy
    )
    # A loop of 0 or 1 trips, not lax.cond: XLA:GPU copies a conditional's operands (every
    # pool, at every step), while a loop updates its carry in place.
    pools = jax.lax.fori_loop(0, admitted.astype(jnp.int32), copy_all, pools)
    return st, layout.constrain_tree(pools, plan.lead)


def _forward(params, layers, st, pools, *, call: Call):
    """One decode step of every slot: logits [D * S, V], the pools with the new keys, experts.

    spec.record_routing: the experts are the input token's [D, S, sparse layers, k]; else None.
    """
    config, plan = call.config, call.plan
    page_size, with_router = call.spec.page_size, call.spec.record_routing
    D, S = plan.shards, plan.slots
    kv_DS = schedule.kv_len(st)
    col_DS = kv_DS // page_size
    page_DS = jnp.take_along_axis(
        st.table_SM, jnp.minimum(col_DS, plan.max_pages - 1)[..., None], 2
    )
    page_DS = jnp.where(st.live_S, page_DS[..., 0], plan.pages)  # idle slots write nowhere
    lens_DS = jnp.where(st.live_S, kv_DS + 1, 0)
    flat = lambda x: layout.constrain(x.reshape(D * S, *x.shape[2:]), plan.lead)
    new_pools = []
    attend_one = functools.partial(
        attention.paged_decode_attention, impl=plan.impl, row_axes=layout.lead_axes(plan.lead)
    )
    if config.batch_invariant:
        attend_one = attention.paged_invariant

    def attend(layer, attn, q_B1Hd, k_B1Kd, v_B1Kd):
        q_B1Hd, k_B1Kd, v_B1Kd = layout.rows_over_tp(q_B1Hd, k_B1Kd, v_B1Kd, plan.lead)
        kv_DSCd = pages.interleave(k_B1Kd[:, 0], v_B1Kd[:, 0]).reshape(D, S, -1, k_B1Kd.shape[-1])
        pool = jax.vmap(pages.write_token)(pools[layer], kv_DSCd, page_DS, kv_DS % page_size)
        pool = layout.constrain_tree(pool, plan.lead)
        new_pools.append(pool)
        q_DSHd = q_B1Hd[:, 0].reshape(D, S, *q_B1Hd.shape[2:])
        out_DSHd = jax.vmap(attend_one)(q_DSHd, pool, st.table_SM, lens_DS)
        out_B1Hd = layout.heads_over_tp(out_DSHd.reshape(D * S, 1, *out_DSHd.shape[2:]), plan.lead)
        return attn.output(out_B1Hd)

    out = models.decode_step(
        config, params, flat(st.prev_S), flat(kv_DS), attend, layers=layers,
        with_router=with_router,
    )  # fmt: skip
    if not with_router:
        return out, tuple(new_pools), None
    logits_BV, experts_LBk = out
    experts_DSLk = experts_LBk.transpose(1, 0, 2).reshape(D, S, *experts_LBk.shape[::2])
    return logits_BV, tuple(new_pools), experts_DSLk


def _draw(st, pools, *, params, layers, rng, call: Call):
    """One decode step of every slot of `st`: tokens and log-probs [D, S], pools, experts."""
    spec, plan = call.spec, call.plan
    D, S = plan.shards, plan.slots
    logits_BV, pools, experts_DSLk = _forward(params, layers, st, pools, call=call)
    row_DS = st.row_S + (plan.rows * jnp.arange(D))[:, None]
    keys = selection.row_keys(rng, row_DS.reshape(-1), st.t_S.reshape(-1))
    tok_B, logp_B = selection.select_tokens(
        keys, logits_BV, **spec.sampling._asdict(), invariant=call.config.batch_invariant
    )
    return tok_B.reshape(D, S), logp_B.reshape(D, S), pools, experts_DSLk


def _draw_all(st, pools, *, call: Call, **kw):
    """_draw on every slot; also the slots it computed per shard."""
    return *_draw(st, pools, call=call, **kw), call.plan.slots


def bucket_sizes(slots: int, buckets: int) -> list:
    """The batch sizes a step may run on: slots x j / buckets for j = 1..buckets, rounded up."""
    return sorted({-(-slots * j // buckets) for j in range(1, buckets + 1)})


_take = jax.vmap(lambda x_S, i_B: x_S[i_B])
_put = jax.vmap(lambda x_S, i_B, v_B: x_S.at[i_B].set(v_B))


def _draw_live(st, pools, *, call: Call, **kw):
    """_draw on the live slots only, packed into the smallest bucket that holds every shard's.

    Slots outside the bucket are idle: their tokens and log-probs stay 0 and nothing reads
    them. Each bucket is a loop of 0 or 1 trips, not lax.switch: a loop updates the pools
    in place, where XLA:GPU copies a conditional's operands.
    """
    config, spec, plan = call
    D, S = plan.shards, plan.slots
    order_DS = jnp.argsort(~st.live_S, axis=1, stable=True)  # live slots first
    live = st.live_S.sum(1).max()
    step = functools.partial(_draw, **kw)
    slot_fields = [f for f in st._fields if f.endswith(("_S", "_SM"))]

    def run(b, carry):
        pools, tok_DS, logp_DS, experts_DSLk, _ = carry
        idx_DB = order_DS[:, :b]
        st_B = st._replace(**{f: _take(getattr(st, f), idx_DB) for f in slot_fields})
        tok_DB, logp_DB, pools, experts_DBLk = step(st_B, pools, call=call.with_slots(b))
        if experts_DBLk is not None:
            experts_DSLk = _put(experts_DSLk, idx_DB, experts_DBLk)
        tok_DS, logp_DS = _put(tok_DS, idx_DB, tok_DB), _put(logp_DS, idx_DB, logp_DB)
        return pools, tok_DS, logp_DS, experts_DSLk, jnp.int32(b)

    experts_DSLk = None
    if spec.record_routing:
        k, dtype = config.num_experts_per_tok, models.moe.expert_dtype(config.num_experts)
        experts_DSLk = jnp.zeros((D, S, config.num_sparse_layers, k), dtype)
    zeros_DS = jnp.zeros((D, S), jnp.int32)
    outs = layout.constrain_tree((zeros_DS, zeros_DS.astype(jnp.float32), experts_DSLk), plan.lead)
    carry = (pools, *outs, jnp.int32(0))
    low = 0
    for b in bucket_sizes(S, spec.live_buckets):
        trips = ((live > low) & (live <= b)).astype(jnp.int32)
        carry = jax.lax.fori_loop(0, trips, lambda _, c, b=b: run(b, c), carry)
        low = b
    pools, tok_DS, logp_DS, experts_DSLk, width = carry
    return tok_DS, logp_DS, pools, experts_DSLk, width


def _record(st, out, tok_DS, logp_DS, experts_DSLk=None):
    """Live rows write their token t, its log-prob and their length t + 1 (others nowhere).

    With routes, also the experts of their input token t - 1: a preempted row that
    recomputes its tokens writes them again, so the last write matches its final tokens.
    """
    tokens_DRN, logps_DRN, gen_len_DR, *routes = out
    rows = tokens_DRN.shape[1]
    row_DS = jnp.where(st.live_S, st.row_S, rows)
    put = jax.vmap(lambda x, r, t, v: x.at[r, t].set(v, mode="drop"))
    tokens_DRN = put(tokens_DRN, row_DS, st.t_S, tok_DS)
    logps_DRN = put(logps_DRN, row_DS, st.t_S, logp_DS)
    gen_len_DR = jax.vmap(lambda x, r, v: x.at[r].set(v, mode="drop"))(
        gen_len_DR, row_DS, st.t_S + 1
    )
    if not routes:
        return tokens_DRN, logps_DRN, gen_len_DR
    put_route = jax.vmap(lambda x, r, t, v: x.at[r, :, t].set(v, mode="drop"))
    routes_DRLNk = put_route(routes[0], row_DS, st.t_S - 1, experts_DSLk)
    return tokens_DRN, logps_DRN, gen_len_DR, routes_DRLNk


_done = jax.vmap(  # status DONE for the rows of the slots that end
    lambda s, r, e: s.at[jnp.where(e, r, s.shape[0])].set(schedule.DONE, mode="drop")
)


def _finish(st, rows, tok_DS, eos_E, *, release=True, fed_DS=None):
    """Rows that stopped are done (and release their pages); the others move to token t + 1.

    fed_DS: tokens that were given, not sampled; a stop id among them stops nothing.
    """
    stop_DS = jnp.isin(tok_DS, eos_E) if fed_DS is None else jnp.isin(tok_DS, eos_E) & ~fed_DS
    ends_DS = st.live_S & (stop_DS | (st.t_S + 1 >= st.limit_S))
    st = st._replace(
        status_R=_done(st.status_R, st.row_S, ends_DS),
        t_S=st.t_S + st.live_S,
        prev_S=jnp.where(st.live_S, tok_DS, st.prev_S),
    )
    if not release:
        return st._replace(live_S=st.live_S & ~ends_DS)
    return jax.vmap(schedule.release)(st, rows, ends_DS)


class Prefilled(NamedTuple):
    """What decode continues from: prefill's first three outputs."""

    staged: tuple  # per layer, the prompts' pages [D, Q, W, page_size, 2K, Dh]
    first_R: jax.Array  # every row's token 0
    logp_R: jax.Array  # and its log-prob


def _decode_rows(prefilled: Prefilled, lengths_P, limit_R, *, call: Call) -> schedule.Rows:
    """Every row's prompt, lengths, token 0 and token limit, laid out [shards, rows]."""
    spec, plan = call.spec, call.plan
    D, Rd, N, G = plan.shards, plan.rows, spec.max_new_tokens, spec.num_samples
    prompt_DQ, prompt_DR = _shard_prompts(plan, G)
    limit_R = jnp.full((D * Rd,), N, jnp.int32) if limit_R is None else limit_R
    return schedule.Rows(
        prompt_R=jnp.asarray(prompt_DR, jnp.int32),
        plen_R=jnp.repeat(lengths_P, G).reshape(D, Rd),
        first_R=prefilled.first_R.reshape(D, Rd),
        limit_R=limit_R.reshape(D, Rd),
        full_Q=lengths_P[prompt_DQ] // spec.page_size,
    )


def _decode_out(rows, logp_R, *, call: Call) -> tuple:
    """(tokens, log-probs, lengths[, experts]) per row with token 0 in place."""
    config, spec, plan = call
    D, Rd, N = plan.shards, plan.rows, spec.max_new_tokens
    out = (
        jnp.zeros((D, Rd, N), jnp.int32).at[:, :, 0].set(rows.first_R),
        jnp.zeros((D, Rd, N), jnp.float32).at[:, :, 0].set(logp_R.reshape(D, Rd)),
        jnp.ones((D, Rd), jnp.int32),
    )
    if spec.record_routing:
        k, dtype = config.num_experts_per_tok, models.moe.expert_dtype(config.num_experts)
        out += (jnp.zeros((D, Rd, config.num_sparse_layers, N, k), dtype),)
    return layout.constrain_tree(out, plan.lead)


def _begin(params, prefilled: Prefilled, lengths_P, eos_E, limit_R, *, call: Call):
    """The rows, the slots after the first admission, the pools and the output buffers."""
    config, spec, plan = call
    D, S, ps = plan.shards, plan.slots, spec.page_size
    rows = _decode_rows(prefilled, lengths_P, limit_R, call=call)
    init = functools.partial(
        schedule.init, slots=S, width=plan.width, max_pages=plan.max_pages, num_pages=plan.pages
    )
    st = layout.constrain_tree(jax.vmap(init, in_axes=(0, None))(rows, eos_E), plan.lead)
    out = _decode_out(rows, prefilled.logp_R, call=call)
    pools = layout.constrain_tree(
        pages.init_pools(config, D, plan.pages, ps, spec.kv_dtype), plan.lead
    )
    st, pools = _admit(st, pools, prefilled.staged, rows, plan=plan, page_size=ps)
    return rows, st, pools, out


class Turns(NamedTuple):
    """The engine's state between the turns of multi-turn rows: rows keep their pages."""

    rows: schedule.Rows
    st: schedule.Slots
    pools: tuple
    out: tuple  # tokens, log-probs, lengths [D, Rd(, N)]: every row's episode so far


class Given(NamedTuple):
    """What a continuing call gets per row [R]: whether it goes on, its token limit (absolute),
    and the tokens fed instead of drawn, [R, N] where mask_RN holds."""

    go_R: jax.Array
    limit_R: jax.Array
    tokens_RN: jax.Array
    mask_RN: jax.Array


def _force(st, forced, tok_DS, logp_DS):
    """Tokens given for (row, t) replace the sampled ones (log-prob 0): fed, not drawn."""
    tokens_DRN, mask_DRN = forced
    at = jax.vmap(lambda x, r, t: x[r, jnp.minimum(t, x.shape[1] - 1)])
    forced_DS = st.live_S & at(mask_DRN, st.row_S, st.t_S)
    tok_DS = jnp.where(forced_DS, at(tokens_DRN, st.row_S, st.t_S), tok_DS)
    return tok_DS, jnp.where(forced_DS, 0.0, logp_DS), forced_DS


def _loop(params, turns: Turns, staged, rng, eos_E, forced=None, *, call: Call):
    """Decode steps until no slot is live and no row waits: (Turns, Stats)."""
    config, spec, plan = call
    rows, st, pools, out = turns
    D, Rd, S, ps = plan.shards, plan.rows, plan.slots, spec.page_size
    layers = models.split_layers(config, params) if layout.on_cpu(plan.lead) else None
    admit = functools.partial(_admit, staged=staged, rows=rows, plan=plan, page_size=ps)
    draw = functools.partial(
        _draw_live if spec.live_buckets > 1 else _draw_all,
        params=params, layers=layers, rng=rng, call=call,
    )  # fmt: skip

    def cond(carry):
        st = carry[0]
        return jnp.any(st.live_S) | jnp.any(st.status_R == schedule.PENDING)

    def body(carry):
        st, pools, out, steps, busy, computed, peak = carry
        busy = busy + st.live_S.sum(dtype=jnp.int32)
        tok_DS, logp_DS, pools, experts_DSLk, width = draw(st, pools)
        computed = computed + D * width
        fed_DS = None
        if forced is not None:
            tok_DS, logp_DS, fed_DS = _force(st, forced, tok_DS, logp_DS)
        out = _record(st, out, tok_DS, logp_DS, experts_DSLk)
        # The static batch with reserved pages: every row was admitted before the loop and
        # holds all its pages, so nothing is freed, grown or admitted inside it.
        static = plan.reserve and S == Rd
        st = _finish(st, rows, tok_DS, eos_E, release=not static, fed_DS=fed_DS)
        if not plan.reserve:
            st = jax.vmap(functools.partial(schedule.grow, page_size=ps))(st, rows)
        if not static:
            st, pools = admit(st, pools)
        peak = jnp.maximum(peak, plan.pages - st.free_P.sum(-1).min())
        return st, pools, out, steps + 1, busy, computed, peak

    held = plan.pages - st.free_P.sum(-1).min()
    zero = jnp.int32(0)
    carry = (st, pools, out, zero, zero, zero, held)
    st, pools, out, steps, busy, computed, peak = jax.lax.while_loop(cond, body, carry)
    stats = Stats(steps, busy, computed, st.preempted.sum(), peak, S, plan.pages)
    return Turns(rows, st, pools, out), stats


def _generation(out, plan, N) -> Generation:
    """The output buffers [D, Rd, ...] as a Generation over all rows."""
    tokens_DRN, logps_DRN, gen_len_DR = out[:3]
    R = plan.shards * plan.rows
    return Generation(tokens_DRN.reshape(R, N), logps_DRN.reshape(R, N), gen_len_DR.reshape(R))


def decode(params, prefilled: Prefilled, lengths_P, rng, eos_E, limit_R=None, *, call: Call):
    """Every row through the slots: (Generation, Stats).

    spec.record_routing: (Generation, routes [rows, sparse layers, N, k]) instead, the
    experts of each fed-back token (a row's last token, never fed back, keeps zeros).
    """
    spec, plan = call.spec, call.plan
    turns = Turns(*_begin(params, prefilled, lengths_P, eos_E, limit_R, call=call))
    turns, stats = _loop(params, turns, prefilled.staged, rng, eos_E, call=call)
    out = turns.out
    gen = _generation(out, plan, spec.max_new_tokens)
    if spec.record_routing:
        routes = out[3]
        gen = (gen, routes.reshape(plan.shards * plan.rows, *routes.shape[2:]))
    return gen, stats


_of_slots = jax.vmap(lambda x_R, row_S: x_R[row_S])  # per shard: each slot's row's value


def check_turns(spec: SamplerSpec, plan: Plan) -> None:
    """Rows that continue need their pages kept: the static batch with reserved pages."""
    if not (plan.reserve and plan.slots == plan.rows) or spec.record_routing:
        raise ValueError(
            "rows continued across turns need slots=0, kv_pages=0 and no record_routing "
            f"(got slots={spec.slots}, kv_pages={spec.kv_pages}, "
            f"record_routing={spec.record_routing})"
        )


def begin_turns(params, prefilled, lengths_P, rng, eos_E, limit_R, *, call: Call):
    """The first turn of every row: (Turns, Stats). Every row is admitted, even one whose
    token 0 ends its turn (a later turn may continue it)."""
    N = call.spec.max_new_tokens
    never_E = jnp.full((1,), -1, jnp.int32)
    rows, st, pools, out = _begin(
        params, prefilled, lengths_P, never_E, jnp.full_like(limit_R, N), call=call
    )
    rows = rows._replace(limit_R=limit_R.reshape(rows.limit_R.shape))
    limit_DS = _of_slots(rows.limit_R, st.row_S)
    ends_DS = st.live_S & (jnp.isin(_of_slots(rows.first_R, st.row_S), eos_E) | (limit_DS <= 1))
    st = st._replace(
        limit_S=limit_DS,
        live_S=st.live_S & ~ends_DS,
        status_R=_done(st.status_R, st.row_S, ends_DS),
    )
    return _loop(params, Turns(rows, st, pools, out), prefilled.staged, rng, eos_E, call=call)


def continue_turns(params, turns: Turns, rng, eos_E, given: Given, *, call: Call):
    """Rows given.go_R decode on from where they stopped, up to their token limit, fed the
    given tokens where given.mask_RN holds: (Turns, Stats)."""
    plan = call.plan
    D, Rd, N = plan.shards, plan.rows, call.spec.max_new_tokens
    st = turns.st
    go_DR = given.go_R.reshape(D, Rd)
    go_DS = _of_slots(go_DR, st.row_S)
    st = st._replace(
        live_S=go_DS,
        limit_S=jnp.where(go_DS, _of_slots(given.limit_R.reshape(D, Rd), st.row_S), st.limit_S),
        status_R=jnp.where(go_DR, schedule.RUNNING, st.status_R),
    )
    forced = (given.tokens_RN.reshape(D, Rd, N), given.mask_RN.reshape(D, Rd, N))
    # No row is admitted or freed inside the static batch: the prompt pages are not read.
    return _loop(params, turns._replace(st=st), None, rng, eos_E, forced, call=call)


def turns_generation(turns: Turns, call: Call) -> Generation:
    """Every row's episode so far (model tokens and the forced ones) as a Generation."""
    return _generation(turns.out, call.plan, call.spec.max_new_tokens)


class Program(NamedTuple):
    """An engine program with its static arguments bound: what a call runs and AOT lowers."""

    jitted: object  # one of the module's jitted programs below
    call: Call

    def __call__(self, *args):
        return self.jitted(*args, call=self.call)

    def trace(self, *args):
        return self.jitted.trace(*args, call=self.call)


def programs(call: Call, turns: bool = False) -> dict:
    """The programs of a call, in the order they run: prefill and decode, or (multi-turn
    rows) prefill, the first turn and a continued turn."""
    names = {"prefill": prefill_jit}
    if turns:
        names |= {"begin": begin_turns_jit, "resume": continue_turns_jit}
    else:
        names["decode"] = decode_jit
    return {name: Program(jitted, call) for name, jitted in names.items()}


prefill_jit = jax.jit(prefill, static_argnames="call")
decode_jit = jax.jit(decode, static_argnames="call")
begin_turns_jit = jax.jit(begin_turns, static_argnames="call")
continue_turns_jit = jax.jit(continue_turns, static_argnames="call", donate_argnames="turns")
