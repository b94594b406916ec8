"""Batch-invariant numerics (model.batch_invariant, issue 47): a row's log-probs are bitwise the
same however it is computed: alone or among other rows, by the sampler (any slots, any page
size) or the trainer (padded or packed, micro-batched, data-parallel, under the gradient)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models, sampler, schema
from ebpo_jax.config import default_config
from ebpo_jax.spec import update_spec
from ebpo_jax.trainer import packing
from ebpo_jax.trainer.batch import MicroBatch
from ebpo_jax.trainer.update import completion_logprobs

NP, G, TP, N = 8, 4, 12, 10  # 32 rows
EOS = 3


def _model(preset, dtype, invariant=True):
    config = models.get_config(preset, dtype=dtype, batch_invariant=invariant)
    return config, models.init_params(config, jax.random.key(1))


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, TP + 1, NP)
    lengths[:2] = 1, TP
    tokens = rng.integers(4, 256, (NP, TP)) * (np.arange(TP)[None] < lengths[:, None])
    return tokens.astype(np.int32), lengths.astype(np.int32)


def _sample(config, params, prompts, slots, page_size):
    """The sampler's rows (tokens, lengths) and its log-probs [rows, N]."""
    spec = sampler.SamplerSpec(
        max_new_tokens=N, num_samples=G, eos_ids=(EOS,), slots=slots, page_size=page_size
    )
    gen = sampler.generate(config, params, *prompts, spec, rng=jax.random.key(7))
    return np.asarray(gen.tokens), np.asarray(gen.lengths), np.asarray(gen.logprobs)


def _batch(prompts, tokens, lengths, rows, groups=True):
    """A padded MicroBatch of `rows`: whole prompt groups, or (groups=False) groups of 1."""
    rows = np.asarray(rows)
    p, g = (rows[::G] // G, G) if groups else (rows // G, 1)
    return MicroBatch(
        prompt_tokens=jnp.asarray(prompts[0][p]),
        prompt_lengths=jnp.asarray(prompts[1][p]),
        tokens=jnp.asarray(tokens[rows].reshape(-1, g, N)),
        lengths=jnp.asarray(lengths[rows].reshape(-1, g)),
    )


@functools.partial(jax.jit, static_argnums=0)
def _padded(config, params, mb):
    return completion_logprobs(config, params, mb, with_entropy=False).reshape(-1, N)


@functools.partial(jax.jit, static_argnums=0)
def _under_grad(config, params, mb):
    """The log-probs the loss sees inside value_and_grad (PPO's new log-probs)."""
    loss = lambda p: (lambda lp: (jnp.sum(lp), lp))(_padded.__wrapped__(config, p, mb))
    (_, logp), _ = jax.value_and_grad(loss, has_aux=True)(params)
    return logp


def _packed(config, params, prompts, tokens, lengths, budget):
    """The packed trainer's log-probs [rows, N], summed over its micro-batches; and their count."""
    c = default_config()
    c.prompts_per_step, c.group_size, c.sampler.max_new_tokens = NP, G, N
    c.loss.tokens_per_microbatch = budget
    lay = packing.layout(update_spec(schema.parse(c)), config, TP)
    mask_BN = np.arange(N)[None] < lengths[:, None]
    plen = jnp.asarray(prompts[1])
    pl = packing.plan(lay, plen, packing.loss_span(jnp.asarray(mask_BN)))
    run = jax.jit(
        lambda p, u: packing.packed_completion_logprobs(
            config,
            p,
            packing.micro_batch(lay, pl, jnp.asarray(prompts[0]), plen, jnp.asarray(tokens), u),
            slots=(NP * G, N),
            with_entropy=False,
        )
    )
    n = int(pl.num_micro)
    return sum(np.asarray(run(params, u)) for u in range(n)), n


def _data_parallel(config, params, mb, devices=4):
    """The padded log-probs with the rows split over `devices` fake devices."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("data",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):
        return _padded(config, params, jax.tree.map(put, mb))


def _ways(config, params, *, sampler_ways=(("all", 16), (2, 4))):
    """name -> log-probs [rows, N] of the same rows, and the rows' lengths."""
    prompts = _prompts()
    B = NP * G
    slots = lambda s: B if s == "all" else s
    sampled = {(s, ps): _sample(config, params, prompts, slots(s), ps) for s, ps in sampler_ways}
    tokens, lengths, _ = sampled[sampler_ways[0]]
    out = {f"sampler slots={s} page={ps}": lp for (s, ps), (_, _, lp) in sampled.items()}
    for tok, ln, _ in sampled.values():
        np.testing.assert_array_equal(tok, tokens)  # the same rows: their log-probs compare
        np.testing.assert_array_equal(ln, lengths)
    everything = _batch(prompts, tokens, lengths, np.arange(B))
    out["trainer padded, 32 rows"] = np.asarray(_padded(config, params, everything))
    out["trainer padded, under the gradient"] = np.asarray(_under_grad(config, params, everything))
    among8 = np.asarray(_padded(config, params, _batch(prompts, tokens, lengths, np.arange(8))))
    alone = [
        np.asarray(_padded(config, params, _batch(prompts, tokens, lengths, [r], False)))[0]
        for r in (0, 5, 31)
    ]
    packed_one, n1 = _packed(config, params, prompts, tokens, lengths, budget=40 * (TP + N))
    packed_many, n3 = _packed(config, params, prompts, tokens, lengths, budget=3 * (TP + N))
    assert (n1, n3 != 1) == (1, True)
    out["trainer packed, one micro-batch"] = packed_one
    out["trainer packed, several micro-batches"] = packed_many
    out["trainer padded, 4 data-parallel devices"] = np.asarray(
        _data_parallel(config, params, everything)
    )
    mask = np.arange(N)[None] < lengths[:, None]
    rows = {name: np.where(mask, lp, 0.0) for name, lp in out.items()}
    rows["trainer padded, among 7 others"] = np.where(mask[:8], among8, 0.0)
    rows["trainer padded, alone"] = np.where(mask[[0, 5, 31]], np.stack(alone), 0.0)
    return rows


def _differences(rows):
    """Names whose rows differ bitwise from the sampler's (same rows compared)."""
    ref = rows[next(iter(rows))]
    pick = {"trainer padded, among 7 others": slice(0, 8), "trainer padded, alone": [0, 5, 31]}
    return [n for n, lp in rows.items() if not np.array_equal(lp, ref[pick.get(n, slice(None))])]


# Every way, every model: slow (about 2.5 minutes each on a loaded 2-core CPU).
CASES = [
    (preset, dtype)
    for preset in ("tiny", "tiny_qwen3", "tiny_moe")
    for dtype in ("float32", "bfloat16")
]


@pytest.mark.slow
@pytest.mark.parametrize("preset,dtype", CASES)
def test_a_rows_logprobs_are_bitwise_the_same_every_way(preset, dtype):
    """Sampler (slots 2 vs all, pages 4 vs 16) and trainer (alone, among 7 / 31, padded vs
    packed, micro-batches, 4 data-parallel devices, under the gradient): np.array_equal."""
    rows = _ways(*_model(preset, dtype))
    assert _differences(rows) == []


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_with_the_mode_off_the_same_comparison_finds_differences(preset):
    """The test above can fail: without the mode the sampler's and trainer's log-probs differ."""
    rows = _ways(*_model(preset, "float32", invariant=False), sampler_ways=(("all", 16),))
    assert len(_differences(rows)) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_the_modes_logprobs_are_the_models(preset):
    """The mode changes rounding only: its log-probs are close to the mode-off forward's."""
    prompts, B = _prompts(), NP * G
    tokens, lengths, on = _sample(*_model(preset, "float32"), prompts, B, 16)
    off = _model(preset, "float32", invariant=False)
    ref = _padded(*off, _batch(prompts, tokens, lengths, np.arange(B)))
    mask = np.arange(N)[None] < lengths[:, None]
    np.testing.assert_allclose(np.where(mask, on, 0), np.where(mask, ref, 0), atol=1e-5)


def test_sampler_logprobs_equal_the_trainers():
    """The default suite's part (the sampler's compile is most of it): 2 sampler slots,
    pages of 4, against the trainer's padded forward of all 32 rows."""
    config, params = _model("tiny", "float32")
    prompts = _prompts()
    tokens, lengths, sampled = _sample(config, params, prompts, 2, 4)
    trained = _padded(config, params, _batch(prompts, tokens, lengths, np.arange(NP * G)))
    mask = np.arange(N)[None] < lengths[:, None]
    np.testing.assert_array_equal(np.where(mask, sampled, 0), np.where(mask, trained, 0))


@pytest.mark.parametrize("invariant", [True, False])
def test_a_rows_forward_alone_equals_it_among_others_only_with_the_mode(invariant):
    """models.forward of 8 rows vs each row alone: bitwise with the mode, not without."""
    config, params = _model("tiny", "float32", invariant)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 256, (8, 24)), jnp.int32)
    forward = jax.jit(lambda p, t: models.forward(config, p, t))
    together = np.asarray(forward(params, tokens))
    alone = np.concatenate([np.asarray(forward(params, tokens[r : r + 1])) for r in range(8)])
    assert np.array_equal(alone, together) == invariant


def test_the_mode_reaches_the_model_and_refuses_meshes_that_split_a_contraction():
    """model.batch_invariant -> ModelConfig.batch_invariant; tp or context > 1 is one line."""
    from ebpo_jax.config import ConfigError, validate
    from ebpo_jax.tasks.protocol import model_config_from

    c = default_config()
    c.model.batch_invariant = True
    assert model_config_from(validate(c).model, 256).batch_invariant
    assert not model_config_from(validate(default_config()).model, 256).batch_invariant
    c.mesh.shape, c.mesh.axes = (2, 2), ("data", "tp")
    with pytest.raises(ConfigError, match=r"^model.batch_invariant=True with mesh tp=2: "):
        validate(c)
    c.mesh.shape, c.mesh.axes = (4,), ("data",)
    c.sampler.mesh = "data=2,tp=2"
    with pytest.raises(ConfigError, match=r"with sampler.mesh tp=2: "):
        validate(c)


def test_the_attentions_gradient_is_the_float64_softmaxs_and_its_forward_keeps_its_bits():
    """attention's custom VJP (a dense softmax per block, rematerialised) against a float64
    masked softmax and against autodiff of the chunked forward; the forward's bits are the
    chunked forward's, so the mode's log-probs do not change."""
    from ebpo_jax.models import invariant as inv

    rng = np.random.default_rng(0)
    B, T, H, K, d = 2, 37, 4, 2, 8  # 37: chunks of 16 with a ragged last one
    q, k, v, w = (rng.normal(size=(B, T, n, d)).astype(np.float32) for n in (H, K, K, H))
    allowed = np.tril(np.ones((T, T), bool))[None].repeat(B, 0)
    allowed[1, :, 30:] = False  # row 1 padded after 30 tokens
    idx, n = inv.visible_keys(jnp.asarray(allowed))
    flat = lambda x: x.reshape(B * T, K, d)

    def loss(q, k, v, chunked):
        args = (q.reshape(B * T, H, d), flat(k), flat(v), idx, n)
        if chunked:
            out = inv._chunked_attention(*args, d**-0.5, jnp.float32, True)
        else:
            out = inv.attention(*args, scale=d**-0.5, dtype=jnp.float32)
        return jnp.sum(out.reshape(B, T, H, d) * w)

    def ref_grads():  # d/dq, d/dk, d/dv of sum(softmax(q k / sqrt d) v * w), float64
        q64, k64, v64, w64 = (np.asarray(x, np.float64) for x in (q, k, v, w))
        kk, vv = (np.repeat(x, H // K, axis=2) for x in (k64, v64))
        s = np.where(allowed[:, None], np.einsum("bthd,bshd->bhts", q64, kk) * d**-0.5, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        dp = np.einsum("bthd,bshd->bhts", w64, vv)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * d**-0.5
        dq = np.einsum("bhts,bshd->bthd", ds, kk)
        fold = lambda x: x.reshape(B, T, K, H // K, d).sum(3)
        dk = fold(np.einsum("bhts,bthd->bshd", ds, q64))
        dv = fold(np.einsum("bhts,bthd->bshd", p, w64))
        return dq, dk, dv

    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, False)
    for g, want in zip(got, ref_grads()):
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-4, atol=1e-5)
    chunked = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, True)
    for g, want in zip(got, chunked):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(loss(q, k, v, False)) == float(loss(q, k, v, True))
