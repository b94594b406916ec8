"""int8 sampler weights (sampler.param_dtype="int8"): every projection matrix as int8 with
one float32 scale per output channel (symmetric: absmax maps to 127.5), made from the
trainer's weights at each weight move; the rest of the model in its compute dtype.

Quantized: attention q, k, v, o; the dense MLP's and the dense_mlp stack's gate, up, down;
the MoE experts' gate, up, down (a scale per layer, expert and output channel). Kept in the
compute dtype: the embedding (a gather of B rows per decode step, no bandwidth to save),
the output head (it alone sets the log-probs TIS/MIS weigh; int8 serving recipes leave
lm_head out too), the MoE router (a flipped top-k changes the experts, not just a rounding) and
the norms (vectors).

The representation and the matmul path are QLoRA's (models/lora.py): qwix's `quantize`
(absmax, per channel) makes a `qwix.QArray` in the weight's Param, the layer scan slices it
like an array, and `lora.matmul` (and MoE's expert weights) dequantize it in the compute
dtype just before the einsum, one layer at a time. HBM holds int8 weights and the weight
move carries int8; whether XLA fuses the dequantize into the matmul's operand read is the
backend's choice (on CPU it does not: the layer is materialized, so CPU decode gains
nothing). qwix's PTQ path (`qwix.quantize_model`) intercepts a model's ops at call time as
its LoRA does, which models/lora.py's docstring explains does not fit our scanned,
graphdef-merged layers; it is not used (not tried).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from ebpo_jax.models.lora import TARGETS
from ebpo_jax.schema import ConfigError

# stack -> dims before a weight's inputs (its layer; its layer and expert)
_STACKS = {"layers": 1, "dense_mlp": 1, "moe": 2}
_INPUT_DIMS = {name: n_in for _, name, n_in in TARGETS.values()}  # o: heads, head_dim


def contracted_axes(path: tuple[str, ...]) -> tuple[int, ...] | None:
    """The input (contracted) axes of the projection at `path` (keys), None for any other
    weight (embedding, head, router, norms)."""
    stack, name = path[0], path[-1]
    if stack not in _STACKS or name not in _INPUT_DIMS:
        return None
    lead = _STACKS[stack]
    return tuple(range(lead, lead + _INPUT_DIMS[name]))


def int8(w, inputs: tuple[int, ...]):
    """`w` as a qwix int8 QArray with a float32 scale per output channel (all non-input axes)."""
    try:  # the [lora] extra: only QLoRA and int8 sampler weights need it
        import qwix
    except ImportError:
        raise ConfigError(
            "sampler.param_dtype='int8' needs qwix: pip install 'ebpo-jax[lora]'"
        ) from None

    keep = tuple(a for a in range(w.ndim) if a not in inputs)
    return qwix.quantize(
        w.astype(jnp.float32), jnp.int8, channelwise_axes=keep, scale_dtype=jnp.float32
    )


def int8_weights(params, dtype):
    """The sampler's int8 copy of plain `params` (nnx.State): projections as int8 QArrays,
    every other weight cast to `dtype` (the model's compute dtype). Jit-able."""

    def one(path, var):
        keys = tuple(str(getattr(k, "key", k)) for k in path)
        inputs = contracted_axes(keys)
        w = var.get_value()
        return var.replace(value=w.astype(dtype) if inputs is None else int8(w, inputs))

    is_var = lambda x: isinstance(x, nnx.Variable)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)
    return jax.tree_util.tree_unflatten(treedef, [one(p, v) for p, v in flat])
