"""Qwen3-MoE sparse MLP: softmax top-k router, dropless expert dispatch by sorting, router stats.

Routing is transformers' Qwen3MoeTopKRouter: softmax over all experts' logits (float32), the
top k, renormalised over those k when `norm_topk_prob`. Dispatch is dropless: the B*T*k
(token, expert) pairs are sorted by expert and run through the experts' SwiGLU as three
grouped matmuls (models/gmm.py), then scattered back and mixed by the routing weights.
`replay_BTk` fixes the experts (routing replay: the sampler's choice); the weights are then
the current router's probabilities of those experts, so the router still gets gradients.

Under a mesh the dispatch is a shard_map whose axes come from the rules table: each
device sorts its own rows (the `batch` axes) and runs every expert on them, the experts'
hidden dim split over the `moe_mlp` axes (tensor parallel, one psum after the down
projection). The expert weights are stored split over the `expert` axes (FSDP-style expert
sharding) and gathered at the shard_map's boundary, as FSDP gathers a dense layer.

Expert parallelism (the sampler's copy under `sampler.expert_parallel`: `expert_parallel_rules`
puts an `expert_parallel` entry in the rules table): the experts are split over the row axes,
E / shards per shard, hidden dim still over tp, so a decode step reads only a shard's own
experts. Each shard all-gathers the step's tokens, expert ids and routing weights over those
axes, runs its experts on the (token, expert) pairs routed to them (a window of sorted pairs
at a time: dropless, whatever the skew), then a reduce-scatter hands each shard its own rows'
sums. Where gathering the other shards' experts sends fewer bytes (prefill's many tokens:
`moves_tokens`), they are gathered instead, as FSDP gathers a layer. Why all-gather and
reduce-scatter, not all-to-all: a dropless all-to-all of static shapes sizes each shard's
buffer for all k of a token's pairs, k times the all-gather's rows; and with top-8 of 128
experts over 8 shards a token visits 5.3 shards on average (4.7 of its 7 others), so even a
ragged all-to-all would save only a third of the bytes. Sampler only: the windows' loop has
a data-dependent trip count (no reverse-mode gradient).
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from ebpo_jax import sharding
from ebpo_jax.models import gmm, invariant
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.lora import dense


def expert_dtype(num_experts: int):
    """The compact integer dtype that holds an expert index (recorded routing)."""
    return jnp.uint8 if num_experts <= 256 else jnp.int16


def route(logits_NE, k: int, norm_topk_prob: bool, replay_Nk=None):
    """(weights [N, k] f32, experts [N, k] int32, probs [N, E] f32) of HF's top-k softmax router."""
    probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
    if replay_Nk is None:
        top_Nk, experts_Nk = jax.lax.top_k(probs_NE, k)
    else:
        experts_Nk = replay_Nk.astype(jnp.int32)
        top_Nk = jnp.take_along_axis(probs_NE, experts_Nk, axis=-1)
    if norm_topk_prob:
        top_Nk = top_Nk / jnp.sum(top_Nk, axis=-1, keepdims=True)
    return top_Nk, experts_Nk, probs_NE


def router_stats(probs_NE, experts_Nk, mask_N):
    """Load-balancing loss (Switch / HF form: E * sum_e f_e P_e), max/mean expert load, entropy.

    Over the tokens where mask_N: f_e is expert e's share of the token-expert assignments,
    P_e its mean router probability; load max/mean is max_e f_e * E (1 = perfectly even).
    """
    E = probs_NE.shape[-1]
    w_N = mask_N.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(w_N), 1.0)
    hits_NE = jnp.sum(jax.nn.one_hot(experts_Nk, E, dtype=jnp.float32), axis=1)
    f_E = jnp.sum(hits_NE * w_N[:, None], 0) / (n * experts_Nk.shape[-1])
    p_E = jnp.sum(probs_NE * w_N[:, None], 0) / n
    entropy_N = -jnp.sum(probs_NE * jnp.log(jnp.maximum(probs_NE, 1e-30)), axis=-1)
    return {
        "lb_loss": E * jnp.sum(jax.lax.stop_gradient(f_E) * p_E),
        "load_max": jax.lax.stop_gradient(jnp.max(f_E) * E),
        "entropy": jax.lax.stop_gradient(jnp.sum(entropy_N * w_N) / n),
    }


def dispatch(x_ND, experts_Nk, weights_Nk, expert_fn, E: int, fixed_order: bool = False):
    """sum_j weights[n, j] * expert_fn(sorted rows, group sizes)[row of (n, j)]: [N, D].

    `fixed_order`: the k terms are summed in order j = 0..k-1 (batch-invariant numerics).
    """
    N, k = experts_Nk.shape
    flat_M = experts_Nk.reshape(-1)
    order_M = jnp.argsort(flat_M, stable=True)
    x_MD = jnp.take(x_ND, order_M // k, axis=0)
    sizes_E = jnp.zeros((E,), jnp.int32).at[flat_M].add(1)
    y_MD = expert_fn(x_MD, sizes_E)
    y_NkD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(N, k, -1)
    if fixed_order:
        return invariant.row_tiles(_mix_in_order, y_NkD, weights_Nk.astype(y_NkD.dtype))
    return jnp.einsum("nkd,nk->nd", y_NkD, weights_Nk.astype(y_NkD.dtype))


def _mix_in_order(y_NkD, w_Nk):
    """sum_j w[n, j] * y[n, j] added in order j = 0..k-1."""
    out_ND = y_NkD[:, 0] * w_Nk[:, :1]
    for j in range(1, y_NkD.shape[1]):
        out_ND = out_ND + y_NkD[:, j] * w_Nk[:, j : j + 1]
    return out_ND


def _axes(rules, name, mesh) -> tuple[str, ...]:
    entry = sharding.logical_to_spec((name,), rules, mesh)[0]
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def swiglu_experts(x_MD, sizes_E, gate_EDI, up_EDI, down_EID, impl):
    """The experts' SwiGLU on expert-sorted rows (three grouped matmuls; impl "invariant":
    by fixed blocks of one expert's rows, models.invariant, each weight cast to x's dtype in
    the block so the loop sums its gradient in the weight's own dtype)."""
    if impl == "invariant":

        def block(x_TD, e):
            w = lambda w_E: w_E[e].astype(x_TD.dtype)
            h_TI = jax.nn.silu(jnp.dot(x_TD, w(gate_EDI))) * jnp.dot(x_TD, w(up_EDI))
            return jnp.dot(h_TI, w(down_EID))

        return gmm.invariant_grouped(block, x_MD, sizes_E, gate_EDI.shape[0])
    gate_MI = gmm.grouped_matmul(x_MD, gate_EDI, sizes_E, impl)
    up_MI = gmm.grouped_matmul(x_MD, up_EDI, sizes_E, impl)
    return gmm.grouped_matmul(jax.nn.silu(gate_MI) * up_MI, down_EID, sizes_E, impl)


def sharded_dispatch(x_ND, experts_Nk, weights_Nk, w, impl, rules=None):
    """`dispatch` through the experts `w` = (gate, up, down): per row shard under a mesh."""
    E, I = w[0].shape[0], w[0].shape[-1]

    def local(x_ND, experts_Nk, weights_Nk, gate, up, down, tp=()):
        fn = lambda x_MD, sizes_E: swiglu_experts(x_MD, sizes_E, gate, up, down, impl)
        y_ND = dispatch(x_ND, experts_Nk, weights_Nk, fn, E, impl == "invariant")
        return jax.lax.psum(y_ND, tp) if tp else y_ND

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return local(x_ND, experts_Nk, weights_Nk, *w)
    rows = _axes(rules, "batch", mesh)
    tp = tuple(a for a in _axes(rules, "moe_mlp", mesh) if a not in rows)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    if x_ND.shape[0] % size(rows):  # e.g. one decode row: rows stay whole
        rows = ()
    if I % size(tp):
        tp = ()
    if ep := _ep_axes(rules, mesh, E):
        return _ep_dispatch((x_ND, experts_Nk, weights_Nk, *w), impl, mesh, rows, tp, ep)
    r, t = P(rows or None), P(None, None, tp or None)
    fn = jax.shard_map(
        lambda *a: local(*a, tp=tp),
        mesh=mesh,
        in_specs=(r, r, r, t, t, P(None, tp or None, None)),
        out_specs=r,
        check_vma=False,  # pallas_call (megablox) outputs carry no varying-axes type
    )
    return fn(x_ND, experts_Nk, weights_Nk, *w)


# The rules-table entry naming the mesh axes the dispatch splits the experts over.
EP_RULE = "expert_parallel"
# A shard's window of sorted (token, expert) pairs, in units of the pairs an even routing
# sends it: a skewed routing runs more windows, none drops a pair.
EP_HEADROOM = 2


def expert_parallel_rules(rules=None) -> tuple:
    """`rules` (None: the defaults) with the experts split over the row (`batch`) axes, stored
    so (`expert`) and dispatched so (EP_RULE)."""
    table = dict(sharding.rules_from(rules=rules))
    table["expert"] = table[EP_RULE] = table["batch"]
    return tuple(table.items())


def expert_parallel_config(config: ModelConfig) -> ModelConfig:
    """`config` whose MoE layers run expert-parallel (ValueError for a dense model)."""
    if not config.is_moe:
        raise ValueError(
            "sampler.expert_parallel needs a mixture-of-experts model (num_experts > 0)"
        )
    return dataclasses.replace(config, sharding_rules=expert_parallel_rules(config.sharding_rules))


def _ep_axes(rules, mesh, num_experts: int) -> tuple[str, ...]:
    """The mesh axes the rules split the dispatch's experts over (() = not expert-parallel)."""
    axes = tuple(a for a in sharding.rules_from(rules=rules).get(EP_RULE, ()) if a in mesh.shape)
    shards = math.prod(mesh.shape[a] for a in axes)
    if num_experts % shards:
        raise ValueError(
            f"sampler.expert_parallel: {num_experts} experts do not split over {axes} ({shards})"
        )
    return axes if shards > 1 else ()


def _ep_dispatch(args, impl, mesh, rows, tp, ep):
    """sharded_dispatch with the experts split over `ep`: tokens gathered over it when the
    rows split over it too (reduce-scattered back), else whole on each shard (summed)."""
    gathered = set(ep) <= set(rows)
    if not gathered and set(ep) & set(rows):
        raise ValueError(f"expert-parallel axes {ep} split only part of the rows' axes {rows}")
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    how = EpLayout(impl, ep, tp, size(ep), gathered)
    r, e = P(rows or None), P(ep, None, tp or None)
    row_shards = size(rows) if gathered else how.shards
    by_tokens = moves_tokens(args[0], args[3:], how.shards, row_shards, size(tp))
    local = functools.partial(_ep_local if by_tokens else _experts_gathered_local, how=how)
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(r, r, r, e, e, P(ep, tp or None, None)),
        out_specs=r,
        check_vma=False,  # as sharded_dispatch
    )
    return fn(*args)


def moves_tokens(x_ND, w, shards: int, row_shards: int, tp_shards: int) -> bool:
    """Whether moving the tokens to the experts (gathered in, reduce-scattered out; summed when
    whole) sends no more bytes per chip than gathering the other shards' experts: true for
    decode's few rows, false for prefill's many, which take the experts as FSDP would."""
    N, D = x_ND.shape
    tokens = 2 * (shards - 1) * N * D * x_ND.dtype.itemsize / row_shards
    experts = (shards - 1) / shards * sum(a.size * a.dtype.itemsize for a in w) / tp_shards
    return tokens <= experts


class EpLayout(NamedTuple):
    """How an expert-parallel dispatch runs on each shard."""

    impl: str  # the grouped matmul (gmm.IMPLS)
    ep: tuple[str, ...]  # the mesh axes the experts split over
    tp: tuple[str, ...]  # the mesh axes their hidden dim splits over
    shards: int  # devices over `ep`
    gathered: bool  # the rows split over `ep` too: gathered, then reduce-scattered back


def _experts_gathered_local(x_ND, experts_Nk, weights_Nk, *w, how: EpLayout):
    """Every expert gathered over `how.ep` onto this shard, run on its own rows."""
    gate, up, down = (jax.lax.all_gather(a, how.ep, axis=0, tiled=True) for a in w)
    fn = lambda x_MD, sizes_E: swiglu_experts(x_MD, sizes_E, gate, up, down, how.impl)
    y_ND = dispatch(x_ND, experts_Nk, weights_Nk, fn, gate.shape[0])
    return jax.lax.psum(y_ND, how.tp) if how.tp else y_ND


def _ep_local(x_ND, experts_Nk, weights_Nk, gate, up, down, *, how: EpLayout):
    """One shard's experts on the pairs routed to them, summed back to the rows' shards."""
    ep = how.ep
    if how.gathered:
        gather = lambda a: jax.lax.all_gather(a, ep, axis=0, tiled=True)
        x_ND, experts_Nk, weights_Nk = gather(x_ND), gather(experts_Nk), gather(weights_Nk)
    E = gate.shape[0]
    local_Nk = experts_Nk - jax.lax.axis_index(ep) * E
    fn = lambda x_MD, sizes_E: swiglu_experts(x_MD, sizes_E, gate, up, down, how.impl)
    window = min(experts_Nk.size, -(-experts_Nk.size * EP_HEADROOM // how.shards // 8) * 8)
    y_ND = owned_dispatch(x_ND, local_Nk, weights_Nk, fn, E, window).astype(x_ND.dtype)
    if how.gathered:
        y_ND = jax.lax.psum_scatter(y_ND, ep, scatter_dimension=0, tiled=True)
    else:
        y_ND = jax.lax.psum(y_ND, ep)
    return jax.lax.psum(y_ND, how.tp) if how.tp else y_ND


def owned_dispatch(x_ND, local_Nk, weights_Nk, expert_fn, E: int, window: int):
    """`dispatch` of only the pairs whose `local_Nk` id is one of the E experts here, `window`
    expert-sorted pairs at a time (as many windows as those pairs need): [N, D] float32."""
    N, k = local_Nk.shape
    mine_M = ((local_Nk >= 0) & (local_Nk < E)).reshape(-1)
    flat_M = jnp.where(mine_M, local_Nk.reshape(-1), E)  # the others sort after every group
    order_M = jnp.argsort(flat_M, stable=True)
    sizes_E = jnp.zeros((E,), jnp.int32).at[flat_M].add(1, mode="drop")
    ends_E, count = jnp.cumsum(sizes_E), jnp.sum(mine_M)
    order_M = jnp.pad(order_M, (0, -order_M.size % window))
    w_M = weights_Nk.reshape(-1).astype(jnp.float32)

    def body(carry):
        lo, out_ND = carry
        pair_W = jax.lax.dynamic_slice_in_dim(order_M, lo, window)
        in_window_E = jnp.clip(ends_E, lo, lo + window) - jnp.clip(
            ends_E - sizes_E, lo, lo + window
        )
        y_WD = expert_fn(jnp.take(x_ND, pair_W // k, axis=0), in_window_E)
        # Rows past the window's groups hold unspecified values (megablox), maybe NaN: where,
        # not a product with zero.
        valid_W = lo + jnp.arange(window) < count
        y_WD = jnp.where(valid_W[:, None], y_WD.astype(jnp.float32) * w_M[pair_W][:, None], 0.0)
        return lo + window, out_ND.at[pair_W // k].add(y_WD)

    out_ND = jnp.zeros((N, x_ND.shape[-1]), jnp.float32)
    return jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.int32(0), out_ND))[1]


class MoE(nnx.Module):
    """Router [D, E] and stacked experts' SwiGLU weights [E, D, I] / [E, I, D]."""

    def __init__(self, config: ModelConfig, lead=()):
        la = ("layers",) * len(lead)
        D, E, I = config.hidden_size, config.num_experts, config.moe_intermediate_size
        pd = config.param_dtype
        zeros = lambda shape, axes: nnx.Param(jnp.zeros(shape, pd), axes=axes)
        self.router = zeros((*lead, D, E), (*la, "embed", "router"))
        self.gate = zeros((*lead, E, D, I), (*la, "expert", "embed", "moe_mlp"))
        self.up = zeros((*lead, E, D, I), (*la, "expert", "embed", "moe_mlp"))
        self.down = zeros((*lead, E, I, D), (*la, "expert", "moe_mlp", "embed"))
        self.k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.impl = "invariant" if config.batch_invariant else config.moe_impl
        self.dtype = config.dtype
        self.rules = config.sharding_rules
        self.num_experts = E

    def __call__(self, x_BTD, mask_BT=None, replay_BTk=None):
        """(out [B, T, D], {"experts": [B, T, k] compact ints, "lb_loss", "load_max", "entropy"})."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        logits_NE = self._router_logits(x_ND)
        replay_Nk = None if replay_BTk is None else replay_BTk.reshape(B * T, self.k)
        weights_Nk, experts_Nk, probs_NE = self._route(logits_NE, replay_Nk)
        # dense: int8 sampler weights (models/quantize.py) are dequantized here; the invariant
        # blocks cast float weights themselves (swiglu_experts), as invariant.dot does.
        w_dtype = None if self.impl == "invariant" else self.dtype
        w = tuple(dense(p.get_value(), w_dtype) for p in (self.gate, self.up, self.down))
        out_ND = sharded_dispatch(
            x_ND, experts_Nk, weights_Nk.astype(self.dtype), w, self.impl, self.rules
        )
        mask_N = jnp.ones((B * T,), bool) if mask_BT is None else mask_BT.reshape(-1)
        aux = router_stats(probs_NE, experts_Nk, mask_N)
        aux["experts"] = experts_Nk.astype(expert_dtype(self.num_experts)).reshape(B, T, self.k)
        return out_ND.reshape(B, T, D), aux

    def _router_logits(self, x_ND):
        """Float32 router logits [N, E] (invariant: by row blocks, the router cast in each)."""
        w_DE, f32 = self.router[...], jnp.float32
        if self.impl == "invariant":
            return invariant.einsum("nd,de->ne", x_ND, w_DE, f32, self.dtype)
        return jnp.einsum("nd,de->ne", x_ND, w_DE.astype(self.dtype), preferred_element_type=f32)

    def _route(self, logits_NE, replay_Nk):
        one = lambda lg, rp=None: route(lg, self.k, self.norm_topk_prob, rp)
        if self.impl != "invariant":
            return one(logits_NE, replay_Nk)
        if replay_Nk is None:
            return invariant.row_tiles(one, logits_NE)
        return invariant.row_tiles(one, logits_NE, replay_Nk)
