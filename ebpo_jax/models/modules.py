"""NNX building blocks of the Llama-3 / Qwen3 decoder; every Param carries logical axis names."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ebpo_jax import sharding
from ebpo_jax.models import invariant
from ebpo_jax.models.config import ModelConfig
from ebpo_jax.models.lora import matmul
from ebpo_jax.models.moe import MoE

# Masked attention logits get this instead of -inf so that a row with no visible key
# (a padding query) gives a uniform softmax rather than NaN.
_MASKED = float(np.finfo(np.float32).min)


def _param(shape, axes, dtype, init="normal"):
    """A Param of `shape` with logical `axes` metadata (read by ebpo_jax.sharding).

    Matrices start at zero here; model.init_params draws them all in one RNG call, because
    one threefry call per parameter makes XLA compile times grow with the parameter count.
    """
    assert len(shape) == len(axes), (shape, axes)
    value = jnp.ones(shape, dtype) if init == "ones" else jnp.zeros(shape, dtype)
    return nnx.Param(value, axes=tuple(axes))


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim/2], with llama3 scaling; float32 like transformers."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    inv_freq = inv_freq.astype(np.float32)
    scaling = config.rope_scaling_dict
    if scaling.get("rope_type", "default") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_cos_sin(config: ModelConfig, positions_BT: jax.Array):
    """cos, sin [B, T, head_dim] float32 for the rotate-half RoPE convention of transformers."""
    if config.batch_invariant:  # one fixed-shape table, gathered: cos/sin never see the batch
        return invariant.rope_table(
            _cos_sin(config.replace(batch_invariant=False)),
            positions_BT,
            config.max_position_embeddings,
        )
    return _cos_sin(config)(positions_BT)


def _cos_sin(config: ModelConfig):
    return lambda positions_BT: _rope_cos_sin(config, positions_BT)


def _rope_cos_sin(config: ModelConfig, positions_BT: jax.Array):
    freqs_BTd = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    emb_BTd = jnp.concatenate([freqs_BTd, freqs_BTd], axis=-1)
    return jnp.cos(emb_BTd), jnp.sin(emb_BTd)


def apply_rope(x_BTHd, cos_BTd, sin_BTd):
    half = x_BTHd.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTHd[..., half:], x_BTHd[..., :half]], axis=-1)
    out = x_BTHd.astype(jnp.float32) * cos_BTd[:, :, None] + rotated * sin_BTd[:, :, None]
    return out.astype(x_BTHd.dtype)


def _rope_rows(x_BTHd, cos_BTd, sin_BTd):
    """apply_rope by fixed blocks of tokens (models.invariant)."""
    B, T = x_BTHd.shape[:2]
    flat = lambda a: a.reshape(B * T, 1, *a.shape[2:])
    out = invariant.row_tiles(apply_rope, flat(x_BTHd), flat(cos_BTd), flat(sin_BTd))
    return out.reshape(x_BTHd.shape)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, output in the compute dtype."""

    def __init__(self, dim, config: ModelConfig, lead=(), axis_name="norm"):
        lead_axes = ("layers",) * len(lead)
        self.scale = _param((*lead, dim), (*lead_axes, axis_name), config.param_dtype, "ones")
        self.eps = config.rms_norm_eps
        self.dtype = config.dtype
        self.invariant = config.batch_invariant

    def __call__(self, x):
        if self.invariant:
            return invariant.per_row(self._norm, x, consts=(self.scale[...],))
        return self._norm(x, self.scale[...])

    def _norm(self, x, scale):
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return normed.astype(self.dtype) * scale.astype(self.dtype)


class Attention(nnx.Module):
    """Grouped-query attention; `project` makes rotated q/k/v, `attend` mixes given k/v."""

    def __init__(self, config: ModelConfig, lead=()):
        c, la = config, ("layers",) * len(lead)
        D, H, K, Dh, pd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.param_dtype
        self.q = _param((*lead, D, H, Dh), (*la, "embed", "heads", "head_dim"), pd)
        self.k = _param((*lead, D, K, Dh), (*la, "embed", "kv_heads", "head_dim"), pd)
        self.v = _param((*lead, D, K, Dh), (*la, "embed", "kv_heads", "head_dim"), pd)
        self.o = _param((*lead, H, Dh, D), (*la, "heads", "head_dim", "embed"), pd)
        self.q_norm = RMSNorm(Dh, c, lead, "head_dim") if c.qk_norm else None
        self.k_norm = RMSNorm(Dh, c, lead, "head_dim") if c.qk_norm else None
        self.dtype = c.dtype
        self.rules = c.sharding_rules
        self.num_kv_heads = K
        self.scale = Dh**-0.5
        self.invariant = c.batch_invariant

    def project(self, x_BTD, cos_BTd, sin_BTd):
        dt, inv = self.dtype, self.invariant
        q_BTHd = matmul("btd,dhk->bthk", x_BTD, self.q, dt, inv)
        k_BTKd = matmul("btd,dhk->bthk", x_BTD, self.k, dt, inv)
        v_BTKd = matmul("btd,dhk->bthk", x_BTD, self.v, dt, inv)
        if self.q_norm is not None:
            q_BTHd, k_BTKd = self.q_norm(q_BTHd), self.k_norm(k_BTKd)
        heads, kv_heads = (
            ("batch", "seq", "act_heads", None),
            ("batch", "seq", "act_kv_heads", None),
        )
        q_BTHd = sharding.constrain(q_BTHd, heads, self.rules)
        k_BTKd = sharding.constrain(k_BTKd, kv_heads, self.rules)
        v_BTKd = sharding.constrain(v_BTKd, kv_heads, self.rules)
        if self.invariant:
            rope = functools.partial(_rope_rows, cos_BTd=cos_BTd, sin_BTd=sin_BTd)
            return rope(q_BTHd), rope(k_BTKd), v_BTKd
        return apply_rope(q_BTHd, cos_BTd, sin_BTd), apply_rope(k_BTKd, cos_BTd, sin_BTd), v_BTKd

    def attend(self, q_BTHd, k_BSKd, v_BSKd, allowed_BTS):
        if self.invariant:
            return self._attend_invariant(q_BTHd, k_BSKd, v_BSKd, allowed_BTS)
        B, T, H, Dh = q_BTHd.shape
        K = self.num_kv_heads
        # Query head h reads kv head h // (H/K), as transformers' repeat_kv does.
        q_BTKGd = q_BTHd.reshape(B, T, K, H // K, Dh)
        logits_BKGTS = jnp.einsum(
            "btkgd,bskd->bkgts", q_BTKGd, k_BSKd, preferred_element_type=jnp.float32
        )
        logits_BKGTS = jnp.where(allowed_BTS[:, None, None], logits_BKGTS * self.scale, _MASKED)
        probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(self.dtype)
        out_BTKGd = jnp.einsum("bkgts,bskd->btkgd", probs_BKGTS, v_BSKd)
        return self.output(out_BTKGd.reshape(B, T, H, Dh))

    def attend_cached(self, q_BTHd, k_BKSd, v_BKSd, allowed_BTS):
        """attend over a head-major cache [B, K, S, Dh] that already holds the new keys.

        Head-major, so that q.K and p.V are plain batched matmuls over each (row, head)'s
        contiguous [S, Dh] slots, read in place on every backend.
        """
        if self.invariant:
            head_major = lambda x: x.transpose(0, 2, 1, 3)
            return self._attend_invariant(
                q_BTHd, head_major(k_BKSd), head_major(v_BKSd), allowed_BTS
            )
        B, T, H, Dh = q_BTHd.shape
        K = self.num_kv_heads
        q_BTKGd = q_BTHd.reshape(B, T, K, H // K, Dh)
        f32 = jnp.float32
        logits_BKGTS = jnp.einsum("btkgd,bksd->bkgts", q_BTKGd, k_BKSd, preferred_element_type=f32)
        logits_BKGTS = jnp.where(allowed_BTS[:, None, None], logits_BKGTS * self.scale, _MASKED)
        probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(self.dtype)
        out_BTKGd = jnp.einsum("bkgts,bksd->btkgd", probs_BKGTS, v_BKSd, preferred_element_type=f32)
        return self.output(out_BTKGd.astype(self.dtype).reshape(B, T, H, Dh))

    def _attend_invariant(self, q_BTHd, k_BSKd, v_BSKd, allowed_BTS):
        allowed_BTS = jnp.broadcast_to(allowed_BTS, (*q_BTHd.shape[:2], k_BSKd.shape[1]))
        out = invariant.attend_masked(
            q_BTHd, k_BSKd, v_BSKd, allowed_BTS, scale=self.scale, dtype=self.dtype
        )
        return self.output(out)

    def output(self, out_BTHd):
        return matmul("bthk,hkd->btd", out_BTHd, self.o, self.dtype, self.invariant)


class MLP(nnx.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: ModelConfig, lead=()):
        la, D, F = ("layers",) * len(lead), config.hidden_size, config.intermediate_size
        pd = config.param_dtype
        self.gate = _param((*lead, D, F), (*la, "embed", "mlp"), pd)
        self.up = _param((*lead, D, F), (*la, "embed", "mlp"), pd)
        self.down = _param((*lead, F, D), (*la, "mlp", "embed"), pd)
        self.dtype = config.dtype
        self.rules = config.sharding_rules
        self.invariant = config.batch_invariant

    def __call__(self, x_BTD):
        weights = tuple(w.get_value() for w in (self.gate, self.up, self.down))
        if self.invariant:  # SiLU too: XLA's vector and scalar exp differ, so fixed blocks
            one = lambda x_TD, *w: self._swiglu(x_TD[None], *w)[0]
            return invariant.per_row(one, x_BTD, consts=weights)
        return self._swiglu(x_BTD, *weights)

    def _swiglu(self, x_BTD, gate_DF, up_DF, down_FD):
        dt = self.dtype
        gate_BTF = matmul("btd,df->btf", x_BTD, gate_DF, dt)
        up_BTF = matmul("btd,df->btf", x_BTD, up_DF, dt)
        hidden_BTF = sharding.constrain(
            jax.nn.silu(gate_BTF) * up_BTF, ("batch", "seq", "act_mlp"), self.rules
        )
        return matmul("btf,fd->btd", hidden_BTF, down_FD, dt)


class Block(nnx.Module):
    """One pre-norm decoder layer; built with lead=(num_layers,) to hold all layers stacked."""

    def __init__(self, config: ModelConfig, lead=(), with_mlp=True):
        self.attn_norm = RMSNorm(config.hidden_size, config, lead)
        self.attn = Attention(config, lead)
        self.mlp_norm = RMSNorm(config.hidden_size, config, lead)
        self.mlp = MLP(config, lead) if with_mlp else None


class Decoder(nnx.Module):
    """Token embedding, stacked layers, final norm and (untied) output head.

    A mixture-of-experts config keeps each layer kind's feed-forward in its own stack:
    `layers` (attention and norms, all layers) has no `mlp`; `moe` stacks the sparse layers'
    and `dense_mlp` the dense layers' (in layer order), so runs of one kind scan.
    """

    def __init__(self, config: ModelConfig):
        V, D, pd = config.vocab_size, config.hidden_size, config.param_dtype
        self.embed = _param((V, D), ("vocab", "embed"), pd)
        self.layers = Block(config, lead=(config.num_layers,), with_mlp=not config.is_moe)
        n_sparse = config.num_sparse_layers
        n_dense = config.num_layers - n_sparse
        self.moe = MoE(config, lead=(n_sparse,)) if config.is_moe and n_sparse else None
        self.dense_mlp = MLP(config, lead=(n_dense,)) if config.is_moe and n_dense else None
        self.final_norm = RMSNorm(D, config)
        self.lm_head = (
            None if config.tie_word_embeddings else _param((D, V), ("embed", "vocab"), pd)
        )
