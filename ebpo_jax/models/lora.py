"""LoRA / QLoRA adapters on the stacked projections, as a separate params pytree.

Hand-written, with qwix only for the quantized base (`qwix.quantize` / `qwix.dequantize`,
pure functions on arrays). qwix's LoRA (`qwix.apply_lora_to_model`) does not fit this
model: it intercepts einsums inside the root module's `__call__`, finds the calling module
from the Python stack's `self` and creates the adapters lazily as attributes of that object
on a first call. Our forward is a function that merges a fresh Block from a graphdef inside
the layer `lax.scan`, so that object is a scan-body temporary (tried on the tiny preset:
`AttributeError: 'Attention' object has no attribute 'qwix_path'`); run on one unstacked
MLP it works but copies the base's logical axes onto the adapters, so the rank dim of
`gate_lora_a` [D, r] is named `mlp` (sharded over `tp`).

Layout: `adapters["layers"][group][name]` = {"a": Param [L, *in, r], "b": Param [L, r, *out]}
for each target (q, k, v, o in `attn`; gate, up, down in `mlp`), with logical axis names
(rank: `lora_rank`, in the rules table). The adapter path replaces each targeted weight in
the params pytree by a `LoraWeight(base, a, b, scale)` (`attach`), which the modules' matmul
(`matmul`) computes as x W + scale (x A) B; the layer scan slices it like any weight. The
merged path is `merge`: W + scale A B, the plain params pytree the sampler and to_hf take.
"""

import dataclasses
import functools
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ebpo_jax.models import invariant as invariant_lib
from ebpo_jax.models.config import ModelConfig

# target -> (module group, param name, number of leading input dims of the weight)
TARGETS = {
    "q": ("attn", "q", 1),
    "k": ("attn", "k", 1),
    "v": ("attn", "v", 1),
    "o": ("attn", "o", 2),
    "gate": ("mlp", "gate", 1),
    "up": ("mlp", "up", 1),
    "down": ("mlp", "down", 1),
}
BASE_DTYPES = ("", "float32", "bfloat16", "int8", "nf4")
_QUANTIZED = ("int8", "nf4")
_NF4_BLOCK = 64  # QLoRA's block size along the input dim


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Adapter hyper-parameters; hashable, so it can be a jit static argument."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    base_dtype: str = ""  # "" = the model's param dtype; int8 / nf4 = QLoRA

    def __post_init__(self):
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"lora rank must be an int >= 1, got {self.rank!r}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(
                f"lora targets {self.targets!r}: expected distinct names of {list(TARGETS)}"
            )
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"lora base_dtype {self.base_dtype!r} is not one of {BASE_DTYPES}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def spec_from_config(lora_config) -> LoraSpec | None:
    """The `model.lora` config section as a LoraSpec; None when rank is 0 (LoRA off)."""
    if int(lora_config.rank) == 0:
        return None
    targets = tuple(t.strip() for t in str(lora_config.targets).split(",") if t.strip())
    return LoraSpec(
        int(lora_config.rank), float(lora_config.alpha), targets, str(lora_config.base_dtype)
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraWeight:
    """A frozen base weight (array or qwix.QArray) with its adapter; a pytree, sliced by scans."""

    base: Any
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata={"static": True})

    @property
    def shape(self):
        return self.base.shape


def _is_qarray(w) -> bool:
    # No QArray exists unless qwix was imported (quantize_base), so plain runs never import it.
    qwix = sys.modules.get("qwix")
    return qwix is not None and isinstance(w, qwix.QArray)


def dense(w, dtype):
    """The weight as an array in `dtype` (None: its own), dequantized when it is a qwix QArray."""
    if _is_qarray(w):
        w = sys.modules["qwix"].dequantize(w)
    return w if dtype is None else w.astype(dtype)


def matmul(eq: str, x, w, dtype, invariant: bool = False):
    """einsum(eq, x, w) in `dtype` for a weight, a quantized weight or a LoraWeight.

    `eq` is like "btd,dhk->bthk": x's last dims contract with w's leading dims.
    `invariant`: by fixed row blocks (models.invariant), whatever the number of rows.
    """
    ein = functools.partial(_einsum, dtype=dtype, invariant=invariant)
    w = w.get_value() if isinstance(w, nnx.Variable) else w
    if not isinstance(w, LoraWeight):
        return ein(eq, x, w)
    lhs_rhs, out = eq.split("->")
    lhs, rhs = lhs_rhs.split(",")
    n_in = w.a.ndim - 1
    assert "r" not in eq, eq
    ins, outs = rhs[:n_in], rhs[n_in:]
    keep = lhs[: len(lhs) - n_in]
    y = ein(eq, x, w.base)
    xa = ein(f"{lhs},{ins}r->{keep}r", x, w.a)
    return y + ein(f"{keep}r,r{outs}->{out}", xa, w.b) * w.scale


def _einsum(eq: str, x, w, dtype, invariant: bool):
    """einsum(eq, x, w in dtype); `invariant`: by row blocks, w cast inside each block."""
    if not invariant:
        return jnp.einsum(eq, x, dense(w, dtype))
    # A float weight keeps its dtype into the blocks, so their loop sums its gradient in that
    # dtype (models.invariant.dot); a quantized one (no gradient) is dequantized first.
    return invariant_lib.einsum(eq, x, dense(w, None), dtype=dtype)


def _shapes(config: ModelConfig):
    """target -> (input dims, input axis names, output dims, output axis names)."""
    D, F, H, K, Dh = (
        config.hidden_size,
        config.intermediate_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
    )
    return {
        "q": ((D,), ("embed",), (H, Dh), ("heads", "head_dim")),
        "k": ((D,), ("embed",), (K, Dh), ("kv_heads", "head_dim")),
        "v": ((D,), ("embed",), (K, Dh), ("kv_heads", "head_dim")),
        "o": ((H, Dh), ("heads", "head_dim"), (D,), ("embed",)),
        "gate": ((D,), ("embed",), (F,), ("mlp",)),
        "up": ((D,), ("embed",), (F,), ("mlp",)),
        "down": ((F,), ("mlp",), (D,), ("embed",)),
    }


def init_adapters(config: ModelConfig, spec: LoraSpec, rng) -> nnx.State:
    """Fresh float32 adapters: A ~ U(+-1/sqrt(fan_in)) (PEFT's kaiming_uniform(a=sqrt 5)), B = 0.

    B = 0 makes the adapted model exactly the base at step 0. Jit-able (shapes are static).
    """
    L, r, shapes = config.num_layers, spec.rank, _shapes(config)
    mlp = [t for t in spec.targets if TARGETS[t][0] == "mlp"]
    if config.is_moe and mlp:
        raise ValueError(
            f"lora targets {mlp}: a mixture-of-experts model adapts attention only (q, k, v, o)"
        )
    keys = jax.random.split(rng, len(spec.targets))
    tree: dict = {}
    for key, t in zip(keys, spec.targets):
        group, name, _ = TARGETS[t]
        ins, in_axes, outs, out_axes = shapes[t]
        bound = 1.0 / math.sqrt(math.prod(ins))
        a = jax.random.uniform(key, (L, *ins, r), jnp.float32, -bound, bound)
        b = jnp.zeros((L, r, *outs), jnp.float32)
        tree.setdefault(group, {})[name] = {
            "a": nnx.Param(a, axes=("layers", *in_axes, "lora_rank")),
            "b": nnx.Param(b, axes=("layers", "lora_rank", *out_axes)),
        }
    return nnx.State({"layers": tree})


def abstract_adapters(config: ModelConfig, spec: LoraSpec) -> nnx.State:
    """Adapter shapes/dtypes without allocating."""
    return jax.eval_shape(lambda: init_adapters(config, spec, jax.random.key(0)))


def _targeted(params, adapters):
    """[(group, name, base Param, adapter dict)] for every adapted projection."""
    out = []
    for group, names in adapters["layers"].items():
        for name, ab in names.items():
            out.append((group, name, params["layers"][group][name], ab))
    return out


def attach(params, adapters, spec: LoraSpec):
    """params whose targeted weights are LoraWeights: `forward` then runs the adapter path.

    Pure and cheap (no weight is copied); call it inside the loss so gradients reach
    `adapters` only.
    """
    out = jax.tree.map(lambda x: x, params)
    for group, name, base, ab in _targeted(params, adapters):
        value = LoraWeight(base.get_value(), ab["a"].get_value(), ab["b"].get_value(), spec.scale)
        out["layers"][group][name] = base.replace(value=value)
    return out


def delta(a, b, scale: float):
    """scale * A B [L, *in, *out] in float32, from A [L, *in, r] and B [L, r, *out]."""
    L, r = a.shape[0], a.shape[-1]
    ins, outs = a.shape[1:-1], b.shape[2:]
    ab = jnp.einsum("lir,lro->lio", a.reshape(L, -1, r), b.reshape(L, r, -1), precision="highest")
    return (scale * ab.astype(jnp.float32)).reshape(L, *ins, *outs)


def merge(params, adapters, spec: LoraSpec, dtype=None):
    """Plain params with W + scale A B in each targeted weight (dequantized for QLoRA).

    `dtype`: of every returned weight (default: each base weight's, float32 for a QArray).
    """
    out = jax.tree.map(lambda x: x, params)
    for group, name, base, ab in _targeted(params, adapters):
        w = base.get_value()
        w_dtype = dtype or (jnp.float32 if _is_qarray(w) else w.dtype)
        d = delta(ab["a"].get_value(), ab["b"].get_value(), spec.scale)
        out["layers"][group][name] = base.replace(value=(dense(w, jnp.float32) + d).astype(w_dtype))
    out = dequantize_base(out, dtype)
    return out if dtype is None else jax.tree.map(lambda x: x.astype(dtype), out)


def _projection_vars(params):
    """[(group, name, Param)] for the projections of the stacked layers (attention only for MoE)."""
    layers = params["layers"]
    return [(g, n, layers[g][n]) for g, n, _ in TARGETS.values() if g in layers]


def quantize_base(params, spec: LoraSpec):
    """QLoRA's frozen base: the seven projections as qwix QArrays (int8 per output channel;
    nf4 in blocks of 64 along the first input dim when it divides, else per channel)."""
    if spec.base_dtype not in _QUANTIZED:
        if not spec.base_dtype:
            return params
        return jax.tree.map(lambda x: x.astype(spec.base_dtype), params)
    import qwix  # the [lora] extra; only QLoRA needs it

    out = jax.tree.map(lambda x: x, params)
    n_inputs = {(g, n): n_in for g, n, n_in in TARGETS.values()}
    for group, name, var in _projection_vars(params):
        n_in = n_inputs[group, name]
        w = var.get_value()
        out_axes = (0, *range(1 + n_in, w.ndim))
        tiled = {}
        if spec.base_dtype == "nf4" and w.shape[1] % _NF4_BLOCK == 0:
            tiled = {1: _NF4_BLOCK}
        qtype = jnp.int8 if spec.base_dtype == "int8" else "nf4"
        q = qwix.quantize(w, qtype, channelwise_axes=out_axes, tiled_axes=tiled)
        out["layers"][group][name] = var.replace(value=q)
    return out


def dequantize_base(params, dtype=None):
    """Plain params from a QLoRA base (QArrays -> arrays in `dtype`, default float32)."""
    out = jax.tree.map(lambda x: x, params)
    for group, name, var in _projection_vars(params):
        if _is_qarray(var.get_value()):
            out["layers"][group][name] = var.replace(
                value=dense(var.get_value(), dtype or jnp.float32)
            )
    return out


def num_adapter_params(config: ModelConfig, spec: LoraSpec) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract_adapters(config, spec)))
