"""Attention kernel dispatch for full sequences: XLA einsums, Pallas splash (TPU), cuDNN (GPU).

`ModelConfig.attention` names the kernel; "auto" picks by the platform being compiled for
(cuDNN on GPU, splash on TPU, XLA otherwise). A new kernel touches this module only.

cuDNN flash attention is reached through `jax.nn.dot_product_attention(implementation=
"cudnn")`, with the causal mask and per-row lengths (`query_seq_lengths` /
`key_value_seq_lengths`) instead of a [T, S] mask, so no score matrix or bias is ever held.
Its contract: q/k/v in bfloat16 or float16 (a float32 model is cast to bfloat16 around the
kernel), head_dim a multiple of 8 and <= 128 (256 on Hopper), rows right-padded. Queries
and keys always have equal lengths here, so top-left and bottom-right causal alignment agree.

Decode (one new query row over a KV cache, `forward_cached`) stays on the XLA path: its
scores are [B, H, 1, S], nothing a flash kernel saves; a step is bound by reading the cache
from HBM, which the XLA einsums do once and in place on the head-major cache, whereas
`dot_product_attention` wants [B, S, K, d] keys (a transpose of the whole cache per step)
and an arbitrary per-slot mask that cuDNN's length masks cannot express.
"""

import jax
import jax.numpy as jnp

from ebpo_jax import sharding

KERNELS = ("xla", "splash", "cudnn")
CHOICES = (*KERNELS, "auto")
# The `implementation` the "cudnn" kernel passes to jax.nn.dot_product_attention. Tests set it
# to "xla" to run the same calls (same masks, lengths, casts) on a CPU, where cuDNN is absent.
FLASH_IMPLEMENTATION = "cudnn"
_FLASH_DTYPES = (jnp.bfloat16, jnp.float16)


def compile_platform() -> str:
    """The platform compiled for: the ambient mesh's devices (AOT on a CPU host), else the backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform


def resolve(name: str, platform: str | None = None) -> str:
    """The kernel `name` means: itself, or for "auto" the one for `platform` (default: ambient)."""
    if name not in CHOICES:
        raise ValueError(f"attention={name!r}; expected one of {CHOICES}")
    if name != "auto":
        return name
    platform = compile_platform() if platform is None else platform
    return {"tpu": "splash", "gpu": "cudnn"}.get(platform, "xla")


def flash_dtype(dtype) -> jnp.dtype:
    """The dtype cuDNN computes attention in for a model of `dtype`: 16-bit kept, else bfloat16."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in _FLASH_DTYPES else jnp.dtype(jnp.bfloat16)


def flash(q_BTHd, k_BSKd, v_BSKd, *, scale, q_len_B, kv_len_B):
    """Causal dot_product_attention over right-padded rows, cast to cuDNN's dtype: [B, T, H, d].

    Query t of row b sees keys s <= t with s < kv_len_B[b]; queries t >= q_len_B[b] give 0.
    Odd lengths T and S are padded by one slot (masked by the lengths): JAX's cuDNN rule
    refuses odd sequence lengths when differentiating.
    """
    dt = flash_dtype(q_BTHd.dtype)
    T = q_BTHd.shape[1]
    even = lambda x: jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0))).astype(dt)
    out_BTHd = jax.nn.dot_product_attention(
        even(q_BTHd),
        even(k_BSKd),
        even(v_BSKd),
        scale=scale,
        is_causal=True,
        query_seq_lengths=q_len_B.astype(jnp.int32),
        key_value_seq_lengths=kv_len_B.astype(jnp.int32),
        implementation=FLASH_IMPLEMENTATION,
    )
    return out_BTHd[:, :T]


def _kernel(config) -> str:
    """The kernel a forward uses: XLA's path in the batch-invariant mode (its attention is
    models.invariant's; splash and cuDNN tile by the batch's shape), else `resolve`'s."""
    return "xla" if config.batch_invariant else resolve(config.attention)


def _causal_allowed(T):
    return jnp.arange(T)[None, :] <= jnp.arange(T)[:, None]


def segment_mask(segment_ids_BT, prefix_ids_BT=None):
    """[B, T, S] bool: key s has query t's segment id, or its prefix id (before causality)."""
    seg_k_B1S = segment_ids_BT[:, None, :]
    allowed_BTS = segment_ids_BT[:, :, None] == seg_k_B1S
    if prefix_ids_BT is not None:
        allowed_BTS |= prefix_ids_BT[:, :, None] == seg_k_B1S
    return allowed_BTS


def make_attend(config, mask_BT, segment_ids_BT=None, prefix_ids_BT=None, slots_BT=None):
    """attend(attn, q, k, v) -> [B, T, D]: causal self-attention, keys masked by mask_BT.

    The splash and cuDNN kernels need right-padded rows (mask_BT a prefix of each row). With
    segment ids (packed rows) a query sees the keys of its own segment and, XLA only, those
    of segment prefix_ids[q] (its group's shared prompt); causal by slot either way, the
    slots being `slots_BT` where given (XLA only). cuDNN takes no segment ids through
    jax.nn.dot_product_attention, so packed rows use XLA there. Under a mesh whose `context`
    axis splits the sequence, keys and values are gathered whole (`kv_seq`) for each layer.
    """
    kernel = _kernel(config)
    if kernel == "splash" and slots_BT is not None and config.attention == "auto":
        kernel = "xla"  # splash cannot order keys by slot; "auto" picks what can
    if kernel == "splash":
        from ebpo_jax.models import splash  # Pallas TPU import, only when asked for

        if prefix_ids_BT is not None or slots_BT is not None:
            raise ValueError(
                "splash attention masks by segment and array order only: prefix_ids and "
                "slots (shared prompts, context parallelism) need attention 'xla'"
            )
        seg_BT = mask_BT if segment_ids_BT is None else segment_ids_BT

        # splash picks interpret mode itself: off when compiling for TPU (AOT from a CPU host
        # included), on otherwise so CPU tests run the kernel interpreted.
        def attend(attn, q_BTHd, k_BTKd, v_BTKd):
            out_BTHd = splash.attention(q_BTHd, k_BTKd, v_BTKd, seg_BT, scale=attn.scale)
            return attn.output(out_BTHd.astype(attn.dtype))

        return attend
    if kernel == "cudnn" and segment_ids_BT is None:
        len_B = mask_BT.astype(jnp.int32).sum(-1)

        def attend(attn, q_BTHd, k_BTKd, v_BTKd):
            out = flash(q_BTHd, k_BTKd, v_BTKd, scale=attn.scale, q_len_B=len_B, kv_len_B=len_B)
            return attn.output(out.astype(attn.dtype))

        return attend
    if slots_BT is None:
        causal_BTS = _causal_allowed(mask_BT.shape[1])[None]
    else:
        causal_BTS = slots_BT[:, None, :] <= slots_BT[:, :, None]
    if segment_ids_BT is not None:
        allowed_BTS = causal_BTS & segment_mask(segment_ids_BT, prefix_ids_BT)
    else:
        allowed_BTS = causal_BTS & mask_BT[:, None, :]
    if sharding.shards_of("seq", config.sharding_rules) == 1:
        return lambda attn, q, k, v: attn.attend(q, k, v, allowed_BTS)
    return _context_attend(config.sharding_rules, allowed_BTS)


def _context_attend(rules, allowed_BTS):
    """XLA attention over a sequence split on the `context` axis: queries stay on their
    shard, each layer all-gathers the row's keys and values (the backward reduce-scatters
    their gradients), so the scores of a shard are [T / context, T]."""
    whole = ("batch", "kv_seq", "act_kv_heads", None)
    allowed_BTS = sharding.constrain(allowed_BTS, ("batch", "seq", "kv_seq"), rules)

    def attend(attn, q_BTHd, k_BTKd, v_BTKd):
        k_BSKd = sharding.constrain(k_BTKd, whole, rules)
        v_BSKd = sharding.constrain(v_BTKd, whole, rules)
        return attn.attend(q_BTHd, k_BSKd, v_BSKd, allowed_BTS)

    return attend


def _completion_flash(attn, q_BNHd, k_BSKd, v_BSKd, L_B, n_B):
    """Completion queries over [prompt slots (Tp), completion slots (N)] keys, by cuDNN.

    Each row's keys are gathered to [its L valid prompt keys, its N completion keys, pad] and
    its queries placed at slots L..L+N-1 of a zero query row of width Tp + N: plain causal
    attention with lengths L + n then gives each completion query exactly its prompt and its
    own causal prefix. The L zero queries in front cost L^2/2 extra scores per row (about 1/8
    of the work at L = Tp = N / 2, little for short prompts); their outputs are dropped.
    """
    N = q_BNHd.shape[1]
    S = k_BSKd.shape[1]  # Tp + N
    slot_S = jnp.arange(S)[None]
    # Key slot s holds prompt key s (s < L), else completion key s - L (prompt slots after).
    src_BS = jnp.where(slot_S < L_B[:, None], slot_S, (S - N) + slot_S - L_B[:, None])
    src_BS = jnp.minimum(src_BS, S - 1)[..., None, None]
    k_BSKd = jnp.take_along_axis(k_BSKd, src_BS, axis=1)
    v_BSKd = jnp.take_along_axis(v_BSKd, src_BS, axis=1)
    rel_BS = slot_S - L_B[:, None]
    q_BSHd = jnp.take_along_axis(q_BNHd, jnp.clip(rel_BS, 0, N - 1)[..., None, None], axis=1)
    q_BSHd = jnp.where(((rel_BS >= 0) & (rel_BS < N))[..., None, None], q_BSHd, 0)
    seen_B = L_B + n_B
    out_BSHd = flash(q_BSHd, k_BSKd, v_BSKd, scale=attn.scale, q_len_B=seen_B, kv_len_B=seen_B)
    at_BN = (L_B[:, None] + jnp.arange(N)[None])[..., None, None]
    return jnp.take_along_axis(out_BSHd, at_BN, axis=1)


def make_grouped_attend(config, prompt_len_P, comp_len_B, *, Tp: int, N: int, G: int):
    """(attend_prompt, attend_comp) for `forward_grouped`'s Tp-slot prompts and N-slot completions.

    attend_prompt(attn, q, k, v) is causal self-attention over the right-padded prompts;
    attend_comp(attn, q_BNHd, k_BSKd, v_BSKd) takes keys [prompt slots (Tp, each prompt
    repeated G times), completion slots (N)] and lets completion n see its prompt's valid
    slots and completions 0..n (< comp_len_B, all N when None). cuDNN where resolved to it;
    the XLA path otherwise (splash only does self-attention, so under "splash" it is XLA).
    """
    B = prompt_len_P.shape[0] * G
    if _kernel(config) == "cudnn":
        L_B = jnp.repeat(prompt_len_P, G)
        n_B = jnp.full((B,), N, jnp.int32) if comp_len_B is None else comp_len_B

        def attend_prompt(attn, q_PTHd, k_PTKd, v_PTKd):
            lens = {"q_len_B": prompt_len_P, "kv_len_B": prompt_len_P}
            out = flash(q_PTHd, k_PTKd, v_PTKd, scale=attn.scale, **lens)
            return attn.output(out.astype(attn.dtype))

        def attend_comp(attn, q_BNHd, k_BSKd, v_BSKd):
            out = _completion_flash(attn, q_BNHd, k_BSKd, v_BSKd, L_B, n_B)
            return attn.output(out.astype(attn.dtype))

        return attend_prompt, attend_comp
    prompt_mask_PT = jnp.arange(Tp)[None] < prompt_len_P[:, None]
    comp_mask_BN = (
        jnp.ones((B, N), bool) if comp_len_B is None else jnp.arange(N)[None] < comp_len_B[:, None]
    )
    allowed_PTS = _causal_allowed(Tp)[None] & prompt_mask_PT[:, None]
    # Completion queries see their prompt's valid slots, then their own causal prefix.
    sees_prompt_BNT = jnp.broadcast_to(jnp.repeat(prompt_mask_PT, G, 0)[:, None], (B, N, Tp))
    causal_BNN = _causal_allowed(N)[None] & comp_mask_BN[:, None]
    allowed_BNS = jnp.concatenate([sees_prompt_BNT, causal_BNN], axis=-1)
    return (
        lambda attn, q, k, v: attn.attend(q, k, v, allowed_PTS),
        lambda attn, q, k, v: attn.attend(q, k, v, allowed_BNS),
    )
