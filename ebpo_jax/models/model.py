"""Functional entry points: init_params, forward, forward_grouped, prefill and the KV cache."""

import functools
import operator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ebpo_jax import sharding
from ebpo_jax.models import attention, decode, invariant
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.modules import Decoder, rope_cos_sin
from ebpo_jax.models.moe import MoE

_REMAT_POLICIES = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@functools.lru_cache(maxsize=64)
def graphdefs(config: ModelConfig):
    """(decoder graphdef, stacked-block graphdef) for `config`, built without allocating."""
    abstract = nnx.eval_shape(lambda: Decoder(config))
    return nnx.graphdef(abstract), nnx.graphdef(abstract.layers)


_FFN_STACKS = {"moe": "moe", "dense": "dense_mlp"}


@functools.lru_cache(maxsize=64)
def _ffn_graphdefs(config: ModelConfig) -> dict:
    """kind -> graphdef of a mixture-of-experts config's per-kind feed-forward stack."""
    abstract = nnx.eval_shape(lambda: Decoder(config))
    stacks = {kind: getattr(abstract, name) for kind, name in _FFN_STACKS.items()}
    return {kind: nnx.graphdef(m) for kind, m in stacks.items() if m is not None}


def _randomize(state, rng, stddev=0.02):
    """Norm scales stay 1; every other leaf ~ N(0, stddev^2) (transformers' initializer_range)."""
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
    draw = [
        i for i, (path, _) in enumerate(paths_leaves) if "'scale'" not in jax.tree_util.keystr(path)
    ]
    leaves = [leaf for _, leaf in paths_leaves]
    sizes = [leaves[i].size for i in draw]
    if sum(sizes) <= 2**26:  # one flat draw compiles fast; huge models draw per leaf
        flat = jax.random.normal(rng, (sum(sizes),), jnp.float32)
        chunks = jnp.split(flat, np.cumsum(sizes)[:-1])
    else:
        keys = jax.random.split(rng, len(draw))
        chunks = [jax.random.normal(k, (n,), jnp.float32) for k, n in zip(keys, sizes)]
    for i, chunk in zip(draw, chunks):
        leaves[i] = (stddev * chunk).reshape(leaves[i].shape).astype(leaves[i].dtype)
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.lru_cache(maxsize=64)
def _init_fn(config: ModelConfig):
    return jax.jit(lambda rng: _randomize(nnx.state(Decoder(config)), rng))


def init_params(config: ModelConfig, rng: jax.Array) -> nnx.State:
    """Random parameters (the nnx.Param state of a Decoder), layers stacked on a leading axis.

    Jit-able; for a sharded init use `jax.jit(partial(init_params, config), out_shardings=...)`.
    """
    return _init_fn(config)(rng)


def abstract_params(config: ModelConfig) -> nnx.State:
    """Parameter shapes/dtypes (jax.ShapeDtypeStruct leaves) without allocating anything."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def output_embedding(config: ModelConfig, params) -> jax.Array:
    """The output head matrix [D, V] (the transposed embedding when tied)."""
    if config.tie_word_embeddings:
        return params["embed"][...].T
    return params["lm_head"][...]


def _check_tokens(config, tokens_BT, name="tokens_BT"):
    if tokens_BT.ndim != 2:
        raise ValueError(f"{name} must be [batch, time]; got shape {tokens_BT.shape}")
    if not jnp.issubdtype(tokens_BT.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer token ids; got dtype {tokens_BT.dtype}")


def _check_shape(name, x, shape):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)}")


def _remat(config, fn):
    if config.remat == "none":
        return fn
    return jax.checkpoint(fn, policy=_REMAT_POLICIES[config.remat], prevent_cse=False)


def _residual(config, x_BTD):
    return sharding.constrain(x_BTD, ("batch", "seq", "act_embed"), config.sharding_rules)


def _embed(config, params, tokens_BT):
    return _residual(config, jnp.take(params["embed"][...], tokens_BT, axis=0).astype(config.dtype))


def _head(config, params, x_BTD, return_hidden):
    final_norm = nnx.merge(graphdefs(config)[0], params).final_norm
    h_BTD = final_norm(x_BTD)
    if return_hidden:
        return h_BTD
    w_DV, f32 = output_embedding(config, params), jnp.float32
    if config.batch_invariant:  # w cast in each row block (invariant.dot)
        logits_BTV = invariant.einsum("btd,dv->btv", h_BTD, w_DV, f32, config.dtype)
    else:
        logits_BTV = jnp.einsum(
            "btd,dv->btv", h_BTD, w_DV.astype(config.dtype), preferred_element_type=f32
        )
    return sharding.constrain(logits_BTV, ("batch", "seq", "act_vocab"), config.sharding_rules)


def head_logprobs(config: ModelConfig, params, h_XD, tokens_X, with_entropy=False):
    """Batch-invariant log-probs (and entropies) [...] of tokens_X from final-normed hidden
    states [..., D]: the head and log-softmax by fixed row blocks, as the sampler's."""
    w_DV = output_embedding(config, params)
    lead = tokens_X.shape
    out = invariant.head_logprobs(
        h_XD.reshape(-1, h_XD.shape[-1]), w_DV, tokens_X.reshape(-1), with_entropy, config.dtype
    )
    return jax.tree.map(lambda x: x.reshape(lead), out)


class LayerModules(NamedTuple):
    """One layer's modules: its block (norms, attention) and its feed-forward, the block's MLP
    or the layer's MoE (then a step also returns the layer's routing, see models/moe.py)."""

    block: nnx.Module
    ffn: nnx.Module


def _block_step(config, modules: LayerModules, x_BTD, rope, attend, mask_BT=None, replay_BTk=None):
    """One layer: (x, route); `attend(attn, q, k, v) -> [B, T, D]` mixes the new q/k/v."""
    block, ffn = modules
    q_BTHd, k_BTKd, v_BTKd = block.attn.project(block.attn_norm(x_BTD), *rope)
    x_BTD = x_BTD + attend(block.attn, q_BTHd, k_BTKd, v_BTKd)
    h_BTD = block.mlp_norm(x_BTD)
    if isinstance(ffn, MoE):
        y_BTD, route = ffn(h_BTD, mask_BT, replay_BTk)
    else:
        y_BTD, route = ffn(h_BTD), None
    return _residual(config, x_BTD + y_BTD), route


def _rows(tree, start, stop, total):
    """Rows [start, stop) of every leaf (the tree itself when that is all of them)."""
    if tree is None or (start == 0 and stop == total):
        return tree
    return jax.tree.map(lambda a: a[start:stop], tree)


def _concat(parts):
    if not parts or parts[0] is None:
        return None
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jnp.concatenate(a), *parts)


def _over_layers(config, params, layer_fn, carry, replay=None):
    """(carry, ys over all layers, routes over sparse layers) by one scan per run of a kind.

    `layer_fn(carry, LayerModules, replay) -> (carry, (y, route))`. A dense model is one run;
    a mixed MoE one scans each run of consecutive same-kind layers (config.layer_runs),
    slicing its layers out of the all-layer and per-kind stacks. `replay` (a tree of
    [num_sparse_layers, ...] arrays) is sliced the same way for the sparse runs.
    """
    block_def = graphdefs(config)[1]
    L, Ls = config.num_layers, config.num_sparse_layers
    ys, routes = [], []
    for kind, start, stop, first in config.layer_runs:
        n = stop - start
        xs = {"block": _rows(params["layers"], start, stop, L)}
        if config.is_moe:
            total = Ls if kind == "moe" else L - Ls
            xs["ffn"] = _rows(params[_FFN_STACKS[kind]], first, first + n, total)
        if kind == "moe" and replay is not None:
            xs["replay"] = _rows(replay, first, first + n, Ls)

        def body(carry, xs, kind=kind):
            block = nnx.merge(block_def, xs["block"])
            ffn = nnx.merge(_ffn_graphdefs(config)[kind], xs["ffn"]) if "ffn" in xs else block.mlp
            return layer_fn(carry, LayerModules(block, ffn), xs.get("replay"))

        unroll = min(config.scan_unroll, n)
        carry, (y, route) = jax.lax.scan(_remat(config, body), carry, xs, unroll=unroll)
        ys.append(y)
        if kind == "moe":
            routes.append(route)
    return carry, _concat(ys), _concat(routes)


def _check_replay(config, routing, shape, name="routing"):
    if routing is None:
        return
    if not config.is_moe:
        raise ValueError(f"{name} (routing replay) needs a mixture-of-experts config")
    _check_shape(name, routing, (config.num_sparse_layers, *shape, config.num_experts_per_tok))


class _Rows(NamedTuple):
    """Where `forward`'s tokens sit: positions [B, T] (None = 0..T-1) and which are real,
    by `mask` [B, T] or packed `segments` (not both; None = every token)."""

    positions: jax.Array | None = None
    mask: jax.Array | None = None
    segments: "Segments | None" = None


def _check_rows(rows: _Rows, B: int, T: int):
    """(positions [B, T], mask [B, T] bool, segments' three id arrays) after checking `rows`."""
    segment_ids, prefix_ids, slots = (None, None, None) if rows.segments is None else rows.segments
    positions, mask = rows.positions, rows.mask
    positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T)) if positions is None else positions
    if segment_ids is not None:
        if mask is not None:
            raise ValueError("pass mask or segment_ids (0 = padding), not both")
        for name, ids in (
            ("segment_ids", segment_ids),
            ("prefix_ids", prefix_ids),
            ("slots", slots),
        ):
            if ids is not None:
                _check_shape(name, ids, (B, T))
        mask = segment_ids != 0
    elif prefix_ids is not None or slots is not None:
        raise ValueError("prefix_ids and slots need segment_ids")
    mask_BT = jnp.ones((B, T), bool) if mask is None else mask.astype(bool)
    _check_shape("positions", positions_BT, (B, T))
    _check_shape("mask", mask_BT, (B, T))
    return positions_BT, mask_BT, (segment_ids, prefix_ids, slots)


def _layer_scan(config, params, tokens_BT, rows: _Rows, *, with_kv=False, routing=None):
    """Embedding and the layer scans of `forward`: (x [B, T, D], k/v [L, B, T, K, d], route)."""
    _check_tokens(config, tokens_BT)
    B, T = tokens_BT.shape
    _check_replay(config, routing, (B, T))
    positions_BT, mask_BT, (segment_ids, prefix_ids, slots) = _check_rows(rows, B, T)
    rope = rope_cos_sin(config, positions_BT)
    attend = attention.make_attend(config, mask_BT, segment_ids, prefix_ids, slots)

    def layer(x_BTD, modules, replay_BTk):
        kv = []

        def attend_keeping_kv(attn, q_BTHd, k_BTKd, v_BTKd):
            kv.extend([k_BTKd, v_BTKd])
            return attend(attn, q_BTHd, k_BTKd, v_BTKd)

        x_BTD, route = _block_step(
            config, modules, x_BTD, rope, attend_keeping_kv, mask_BT, replay_BTk
        )
        return x_BTD, ((tuple(kv) if with_kv else None), route)

    return _over_layers(config, params, layer, _embed(config, params, tokens_BT), routing)


class Segments(NamedTuple):
    """Packed rows' segments: ids [B, T] int (0 = padding) confine attention to a query's own
    segment; prefix_ids [B, T] (XLA attention only) also open segment prefix_ids[b, t] to it;
    slots [B, T] (XLA only), each token's place in its row before a permutation (context
    parallelism's zig-zag), is the order causality follows (None = the array's own order)."""

    ids: jax.Array
    prefix_ids: jax.Array | None = None
    slots: jax.Array | None = None


def forward(
    config: ModelConfig,
    params,
    tokens_BT,
    *,
    positions=None,
    mask=None,
    return_hidden=False,
    segments: Segments | None = None,
    routing=None,
    with_router=False,
):
    """Logits [B, T, V] float32 (or final-normed hidden [B, T, D]); causal by slot, keys masked.

    Packed rows: `segments` (trainer/packing.py builds them) instead of `mask`, and
    `positions` [B, T] restart per sequence.
    Mixture of experts: `routing` [sparse layers, B, T, k] replays recorded experts;
    `with_router` returns (out, route): route["experts"] [sparse layers, B, T, k] compact
    ints and per-layer router stats [sparse layers] ("lb_loss", "load_max", "entropy").
    """
    rows = _Rows(positions, mask, segments)
    x_BTD, _, route = _layer_scan(config, params, tokens_BT, rows, routing=routing)
    out = _head(config, params, x_BTD, return_hidden)
    return (out, route) if with_router else out


def prefill(
    config: ModelConfig, params, tokens_BT, *, mask, cache_size: int, logits_at, with_router=False
):
    """Whole prompts at slots [0, T): (logits [B, V] at time index logits_at[b], KV cache).

    The cache is init_cache's with the prompt's keys and values in slots [0, T), ready for
    forward_cached at start=T. Unlike forward_cached this is `forward`'s layer scan with its
    attention (splash where configured): XLA compiles one layer body, where a Python loop
    over 36 layers took ten minutes to compile for an 8B config, and held more memory.
    `with_router`: also the prompt's route (as `forward`'s), a third output.
    """
    B, T = tokens_BT.shape
    if not T <= cache_size:
        raise ValueError(f"{T} prompt tokens do not fit a cache of {cache_size} slots")
    _check_shape("logits_at", logits_at, (B,))
    x_BTD, (k_LBTKd, v_LBTKd), route = _layer_scan(
        config, params, tokens_BT, _Rows(mask=mask), with_kv=True
    )
    x_B1D = jnp.take_along_axis(x_BTD, logits_at.astype(jnp.int32)[:, None, None], axis=1)
    logits_BV = _head(config, params, x_B1D, False)[:, 0]
    dtype = config.dtype

    def layer_cache(x_BTKd):  # head-major, slots after the prompt empty
        x_BKTd = x_BTKd.astype(dtype).transpose(0, 2, 1, 3)
        return jnp.pad(x_BKTd, ((0, 0), (0, 0), (0, cache_size - T), (0, 0)))

    cache = {
        name: tuple(layer_cache(x[layer]) for layer in range(config.num_layers))
        for name, x in (("k", k_LBTKd), ("v", v_LBTKd))
    }
    return (logits_BV, cache, route) if with_router else (logits_BV, cache)


class GroupedRows(NamedTuple):
    """`forward_grouped`'s rows: P prompts [P, Tp] of lengths [P], and B = P x G completions
    [B, N] (row b continues prompt b // G), comp_len_B [B] masking completion keys (None =
    all N real)."""

    prompt_PTp: jax.Array
    prompt_len_P: jax.Array
    comp_BN: jax.Array
    comp_len_B: jax.Array | None = None


def _check_grouped(config, rows: GroupedRows, routing):
    """ValueError unless forward_grouped's inputs have matching shapes."""
    prompt_PTp, prompt_len_P, comp_BN, comp_len_B = rows
    _check_tokens(config, prompt_PTp, "prompt_PTp")
    _check_tokens(config, comp_BN, "comp_BN")
    (P, Tp), (B, N) = prompt_PTp.shape, comp_BN.shape
    if B % P:
        raise ValueError(f"comp_BN has {B} rows, not a multiple of the {P} prompts")
    _check_shape("prompt_len_P", prompt_len_P, (P,))
    if comp_len_B is not None:
        _check_shape("comp_len_B", comp_len_B, (B,))
    if routing is not None:
        _check_replay(config, routing[0], (P, Tp), "routing[0]")
        _check_replay(config, routing[1], (B, N), "routing[1]")


def forward_grouped(
    config: ModelConfig,
    params,
    rows: GroupedRows,
    *,
    return_hidden=False,
    routing=None,
    with_router=False,
):
    """Each prompt once, its G = B/P completions attending to it: (prompt out, completion out).

    Equal to `forward` on the packed rows prompt_PTp[p, :len] + comp_BN[b] (completion token
    n at position len + n), but the prompt's layers run once per group instead of G times.
    Out: [P, Tp, V] and [B, N, V] logits float32, or final-normed hidden [.., D].
    Attention is cuDNN's where configured, else XLA's (splash only does self-attention).
    Mixture of experts: `routing` = (prompt [sparse layers, P, Tp, k], completion [.., B, N,
    k]) replays recorded experts; `with_router` adds a third output, (prompt route,
    completion route) as `forward`'s.
    """
    _check_grouped(config, rows, routing)
    prompt_PTp, prompt_len_P, comp_BN, comp_len_B = rows
    (P, Tp), (B, N) = prompt_PTp.shape, comp_BN.shape
    G = B // P
    pos_PT = jnp.broadcast_to(jnp.arange(Tp), (P, Tp))
    pos_BN = jnp.repeat(prompt_len_P, G)[:, None] + jnp.arange(N)[None]
    rope_p, rope_c = rope_cos_sin(config, pos_PT), rope_cos_sin(config, pos_BN)
    attend_p, attend_c = attention.make_grouped_attend(
        config, prompt_len_P, comp_len_B, Tp=Tp, N=N, G=G
    )
    prompt_mask_PT = jnp.arange(Tp)[None] < prompt_len_P[:, None]
    comp_mask_BN = None if comp_len_B is None else jnp.arange(N)[None] < comp_len_B[:, None]

    def layer(carry, modules, replay):
        xp_PTD, xc_BND = carry
        replay_p, replay_c = (None, None) if replay is None else replay
        prompt_kv = []

        def attend_prompt(attn, q_PTHd, k_PTKd, v_PTKd):
            prompt_kv.extend([jnp.repeat(k_PTKd, G, 0), jnp.repeat(v_PTKd, G, 0)])
            return attend_p(attn, q_PTHd, k_PTKd, v_PTKd)

        def attend_comp(attn, q_BNHd, k_BNKd, v_BNKd):
            k_BSKd = jnp.concatenate([prompt_kv[0], k_BNKd], axis=1)
            v_BSKd = jnp.concatenate([prompt_kv[1], v_BNKd], axis=1)
            return attend_c(attn, q_BNHd, k_BSKd, v_BSKd)

        step = functools.partial(_block_step, config, modules)
        xp_PTD, route_p = step(xp_PTD, rope_p, attend_prompt, prompt_mask_PT, replay_p)
        xc_BND, route_c = step(xc_BND, rope_c, attend_comp, comp_mask_BN, replay_c)
        return (xp_PTD, xc_BND), (None, None if route_p is None else (route_p, route_c))

    embed = (_embed(config, params, prompt_PTp), _embed(config, params, comp_BN))
    (xp_PTD, xc_BND), _, route = _over_layers(config, params, layer, embed, routing)
    head = functools.partial(_head, config, params, return_hidden=return_hidden)
    if with_router:
        return head(xp_PTD), head(xc_BND), route
    return head(xp_PTD), head(xc_BND)


def init_cache(config: ModelConfig, batch: int, max_len: int) -> dict:
    """Empty KV cache {'k','v'}: per layer a [batch, kv_heads, max_len, head_dim] array.

    cache['k'][layer] is one layer's keys. One buffer per layer lets each decode step update
    the cache in place; slicing a layer-stacked cache in a layer scan copied every layer's
    cache on every step (decode at batch 256 was 1.37x slower). Head-major (slots inside
    heads) so that decode attention reads each (row, head) as one contiguous [max_len,
    head_dim] matrix; a slot-major cache made XLA transpose it per step.
    """
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)

    def zeros():
        return tuple(jnp.zeros(shape, config.dtype) for _ in range(config.num_layers))

    return {"k": zeros(), "v": zeros()}


def _static_int(x):
    """x as a Python int when it is concrete (not traced), else None."""
    if isinstance(x, (int, np.integer)):
        return int(x)
    return None


def _check_cache(config, cache, batch):
    """The cache's slot count S, after checking it has init_cache's structure and shapes."""
    L = config.num_layers
    if not isinstance(cache, dict) or set(cache) != {"k", "v"}:
        raise ValueError("cache must be a dict with keys 'k' and 'v' (see init_cache)")
    for name in ("k", "v"):
        if not isinstance(cache[name], (tuple, list)) or len(cache[name]) != L:
            raise ValueError(f"cache['{name}'] must hold one array per layer ({L}; see init_cache)")
    if jnp.ndim(cache["k"][0]) != 4:
        raise ValueError(
            f"cache['k'][0] must be 4-d (see init_cache); got {jnp.shape(cache['k'][0])}"
        )
    S = jnp.shape(cache["k"][0])[2]
    shape = (batch, config.num_kv_heads, S, config.head_dim)
    for name in ("k", "v"):
        for layer, x in enumerate(cache[name]):
            _check_shape(f"cache['{name}'][{layer}]", x, shape)
    return S


def split_layers(config: ModelConfig, params) -> tuple:
    """The layer-stacked weights as one params tree per layer (forward_cached's `layers`).

    A mixture-of-experts config's entries are (layer tree, its feed-forward stack's row).
    """
    layers = tuple(
        jax.tree.map(operator.itemgetter(layer), params["layers"])
        for layer in range(config.num_layers)
    )
    if not config.is_moe:
        return layers
    ffns = []
    for kind, start, stop, first in config.layer_runs:
        stack = params[_FFN_STACKS[kind]]
        ffns += [jax.tree.map(operator.itemgetter(first + i), stack) for i in range(stop - start)]
    return tuple(zip(layers, ffns))


def _layer_modules(config, block_def, layer_params, kind) -> LayerModules:
    """One layer's modules from one entry of `split_layers`."""
    if not config.is_moe:
        block = nnx.merge(block_def, layer_params)
        return LayerModules(block, block.mlp)
    block = nnx.merge(block_def, layer_params[0])
    return LayerModules(block, nnx.merge(_ffn_graphdefs(config)[kind], layer_params[1]))


def decode_step(
    config: ModelConfig, params, tokens_B, positions_B, attend, *, layers=None, with_router=False
):
    """Logits [B, V] float32 for one new token per row, its attention left to the caller.

    `attend(layer, attn, q_B1Hd, k_B1Kd, v_B1Kd) -> [B, 1, D]` stores the new key/value in
    the caller's cache (any layout: the sampler's is paged) and mixes the row's cached ones.
    `layers`: `split_layers(params)`, computed once outside a decode loop. `with_router`
    (mixture of experts): also the token's experts [sparse layers, B, k] (compact ints).
    """
    _check_tokens(config, tokens_B[:, None], "tokens_B")
    rope = rope_cos_sin(config, positions_B[:, None])
    block_def = graphdefs(config)[1]
    layers = split_layers(config, params) if layers is None else layers
    x_B1D = _embed(config, params, tokens_B[:, None])
    experts = []
    # A Python loop over layers, not a scan: each layer's cache stays its own buffer.
    for layer, kind in enumerate(config.layer_kinds):
        modules = _layer_modules(config, block_def, layers[layer], kind)
        x_B1D, route = _block_step(config, modules, x_B1D, rope, functools.partial(attend, layer))
        if route is not None:
            experts.append(route["experts"][:, 0])
    logits_BV = _head(config, params, x_B1D, False)[:, 0]
    if not with_router:
        return logits_BV
    return logits_BV, jnp.stack(experts) if experts else None


def _write(cache_BKSd, new_BTKd, start):
    """The cache with new_BTKd's T slots written at `start` (a scalar, or per row [B])."""
    new_BKTd = new_BTKd.astype(cache_BKSd.dtype).transpose(0, 2, 1, 3)
    if jnp.ndim(start) == 0:
        return jax.lax.dynamic_update_slice(cache_BKSd, new_BKTd, (0, 0, start, 0))
    write = lambda c_KSd, x_KTd, s: jax.lax.dynamic_update_slice(c_KSd, x_KTd, (0, s, 0))
    return jax.vmap(write)(cache_BKSd, new_BKTd, start)


def _cached_allowed(slot_BT, kv_mask_BS, kv_len_B):
    """allowed(start, n) -> [B, T, n]: causal by slot, then kv_mask_BS or slots < kv_len_B."""

    def allowed(start, n):
        slots_N = start + jnp.arange(n)
        ok_BTN = slots_N[None, None] <= slot_BT[..., None]
        if kv_mask_BS is not None:
            mask_BN = jax.lax.dynamic_slice_in_dim(kv_mask_BS.astype(bool), start, n, axis=1)
            ok_BTN = ok_BTN & mask_BN[:, None]
        if kv_len_B is not None:
            ok_BTN = ok_BTN & (slots_N[None] < kv_len_B[:, None])[:, None]
        return ok_BTN

    return allowed


class CacheSlots(NamedTuple):
    """Where forward_cached's T new tokens go: cache slots from `start` (a Python int, a
    scalar, or [B] per row), RoPE `positions_BT`, and which slots are valid: kv_mask_BS [B, S]
    and/or kv_len_B [B] (slots below it; at least one of the two)."""

    start: jax.Array | int
    positions_BT: jax.Array
    kv_mask_BS: jax.Array | None = None
    kv_len_B: jax.Array | None = None


def _check_cached(config, tokens_BT, cache, slots: CacheSlots, logits_at):
    """(B, T, the start as a Python int or None) after checking forward_cached's inputs."""
    _check_tokens(config, tokens_BT)
    B, T = tokens_BT.shape
    S = _check_cache(config, cache, B)
    start = slots.start
    _check_shape("positions_BT", slots.positions_BT, (B, T))
    if slots.kv_mask_BS is None and slots.kv_len_B is None:
        raise ValueError("forward_cached needs kv_mask_BS or kv_len_B (which slots are valid)")
    if slots.kv_mask_BS is not None:
        _check_shape("kv_mask_BS", slots.kv_mask_BS, (B, S))
    if slots.kv_len_B is not None:
        _check_shape("kv_len_B", slots.kv_len_B, (B,))
    if logits_at is not None:
        _check_shape("logits_at", logits_at, (B,))
    if jnp.ndim(start) not in (0, 1) or (jnp.ndim(start) == 1 and jnp.shape(start) != (B,)):
        raise ValueError(f"start must be a scalar or [{B}] per row; got shape {jnp.shape(start)}")
    static_start = _static_int(start)
    if static_start is not None and not 0 <= static_start <= S - T:
        raise ValueError(f"start {static_start} + {T} new tokens does not fit a cache of {S} slots")
    return B, T, static_start


def _at(config, params, x_BTD, logits_at):
    """Logits [B, T, V] float32, or [B, V] at time index logits_at[b] of each row."""
    if logits_at is None:
        return _head(config, params, x_BTD, False)
    x_B1D = jnp.take_along_axis(x_BTD, logits_at.astype(jnp.int32)[:, None, None], axis=1)
    return _head(config, params, x_B1D, False)[:, 0]


def forward_cached(
    config: ModelConfig,
    params,
    tokens_BT,
    cache,
    slots: CacheSlots,
    *,
    logits_at=None,
    layers=None,
    kv_block=decode.BLOCK,
    with_router=False,
):
    """Runs T new tokens at cache slots [start, start+T); returns (logits [B,T,V] f32, new cache).

    Query slot start+t attends the valid cache slots j <= start+t (`CacheSlots`); the caller
    marks the new slots valid and keeps start+T <= max_len (checked for a Python int start,
    which also lets attention skip the slots >= start+T). A traced start reads the slots below
    max(start)+T in blocks of `kv_block` (models.decode): a step costs the valid prefix.
    `logits_at` [B] int: only logits [B, V] at time index logits_at[b]. `layers`:
    `split_layers(params)` once outside a decode loop (XLA:CPU does not hoist the slicing
    out of a while_loop). `with_router`: also the new tokens' route (as `forward`'s).
    """
    B, T, static_start = _check_cached(config, tokens_BT, cache, slots, logits_at)
    start = jnp.asarray(slots.start, jnp.int32)
    slot_BT = jnp.broadcast_to(start[..., None] + jnp.arange(T, dtype=jnp.int32), (B, T))
    allowed = _cached_allowed(slot_BT, slots.kv_mask_BS, slots.kv_len_B)
    rope = rope_cos_sin(config, slots.positions_BT)
    block_def = graphdefs(config)[1]
    x_BTD = _embed(config, params, tokens_BT)
    new_k, new_v, routes = [], [], []
    layers = split_layers(config, params) if layers is None else layers
    # A Python loop over layers, not a scan: each layer's cache stays its own buffer.
    for layer, kind in enumerate(config.layer_kinds):
        modules = _layer_modules(config, block_def, layers[layer], kind)

        def attend(attn, q_BTHd, k_BTKd, v_BTKd, layer=layer):
            # Write the new keys first, then read the updated cache: reading the old cache
            # after the write was issued would make XLA copy the layer's whole cache.
            k_BKSd = _write(cache["k"][layer], k_BTKd, start)
            v_BKSd = _write(cache["v"][layer], v_BTKd, start)
            new_k.append(k_BKSd)
            new_v.append(v_BKSd)
            if static_start is not None:  # slots >= start+T are never seen: slice them off
                seen = static_start + T
                return attn.attend_cached(
                    q_BTHd, k_BKSd[:, :, :seen], v_BKSd[:, :, :seen], allowed(0, seen)
                )
            limit = jnp.max(slot_BT) + 1
            return decode.attend_prefix(attn, q_BTHd, k_BKSd, v_BKSd, allowed, limit, kv_block)

        x_BTD, route = _block_step(config, modules, x_BTD, rope, attend)
        if route is not None:
            routes.append(route)
    new_cache = {"k": tuple(new_k), "v": tuple(new_v)}
    out = _at(config, params, x_BTD, logits_at)
    if with_router:
        route = jax.tree.map(lambda *a: jnp.stack(a), *routes) if routes else None
        return out, new_cache, route
    return out, new_cache
