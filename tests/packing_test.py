"""Packed update (trainer/packing.py): packed == padded loss and gradients; planner properties."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ebpo_jax import advantages, losses, models, schema
from ebpo_jax.config import ConfigError, default_config, validate
from ebpo_jax.spec import update_spec
from ebpo_jax.trainer import packing
from ebpo_jax.trainer.batch import MicroBatch
from ebpo_jax.trainer.update import completion_logprobs

P, G, TP, N = 3, 4, 7, 6
KL_COEF, ENT_COEF = 0.1, 0.01
MICRO_BATCH = jax.jit(packing.micro_batch, static_argnums=0)


def _layout(config, *args, **kwargs):
    return packing.layout(update_spec(schema.parse(config)), *args, **kwargs)


def _config(budget, row_len=0, P=P, G=G, N=N):
    c = default_config()
    c.prompts_per_step, c.group_size, c.sampler.max_new_tokens = P, G, N
    c.loss.tokens_per_microbatch, c.loss.pack_row_len = budget, row_len
    return c


def _rollout(seed, P=P, G=G, Tp=TP, N=N, vocab=256):
    """Mixed lengths: prompts of 1 .. Tp tokens, completions of 0 .. N, one group masked out."""
    rng = np.random.default_rng(seed)
    plen_P = rng.integers(1, Tp + 1, P)
    plen_P[:2] = 1, Tp
    clen_B = rng.integers(0, N + 1, P * G)
    clen_B[:3] = N, 1, 0
    mask_PGN = (np.arange(N) < clen_B[:, None]).reshape(P, G, N)
    mask_PGN[-1, :2] = False  # e.g. a DAPO-masked truncated response, a dropped sample
    tokens = lambda shape, n_R: rng.integers(1, vocab, shape) * (np.arange(shape[1]) < n_R[:, None])
    return MicroBatch(
        prompt_tokens=jnp.asarray(tokens((P, Tp), plen_P), jnp.int32),
        prompt_lengths=jnp.asarray(plen_P, jnp.int32),
        tokens=jnp.asarray(tokens((P * G, N), clen_B).reshape(P, G, N), jnp.int32),
        lengths=jnp.asarray(clen_B.reshape(P, G), jnp.int32),
        logprobs=jnp.asarray(-rng.uniform(0.5, 8.0, (P, G, N)), jnp.float32),
        loss_mask=jnp.asarray(mask_PGN),
    ), rng.integers(0, 2, (P, G)).astype(np.float32)


def _grad_fn(model_config, lay):
    """step.py's grad_fn with the loss sum_a w_A[a] * loss_a over the aggregation modes a.

    `denom` is (denominators [A], weights w_A): a one-hot w_A gives one mode's loss and exact
    gradient, from one compiled backward. Log-probs are the padded path's (lay None) or the
    packed one's.
    """

    def logprobs(params, mb, with_entropy):
        if mb.packed is not None:
            return packing.packed_completion_logprobs(
                model_config, params, mb.packed, slots=(P * G, N), with_entropy=with_entropy
            )
        return completion_logprobs(model_config, params, mb, with_entropy=with_entropy)

    def loss_fn(params, ref_params, mb, denom):
        denom_A, w_A = denom
        logp_BN, ent_BN = logprobs(params, mb, True)
        ref_BN = jax.lax.stop_gradient(logprobs(ref_params, mb, False))
        mask_BN = mb.loss_mask.reshape(-1, N)
        # step.py's weighting: local token-mean metrics become mini-batch means.
        share = mask_BN.sum() / jnp.maximum(
            mask_BN.sum() if mb.mb_tokens is None else mb.mb_tokens, 1.0
        )
        loss_A, metrics_A = [], []
        for agg, d in zip(losses.AGG_MODES, denom_A):
            terms = losses.TokenTerms(
                logp_BN,
                mb.logprobs.reshape(-1, N),
                mb.adv.reshape(-1),
                mask_BN,
                ref_logp_BT=ref_BN,
                entropy_BT=ent_BN,
            )
            opts = losses.LossOptions(
                clip_low=0.2, clip_high=0.28, agg=agg, kl_coef=KL_COEF, entropy_coef=ENT_COEF
            )
            loss, metrics = losses.policy_loss(terms, opts, denominator=d)
            loss_A.append(loss)
            metrics_A.append({k: v * share if "clip_frac" in k else v for k, v in metrics.items()})
        loss_A = jnp.stack(loss_A)
        metrics_A = jax.tree.map(lambda *x: jnp.stack(x), *metrics_A)
        return jnp.dot(w_A, loss_A), (loss_A, metrics_A)

    def grad_fn(params, ref_params, mb, denom):
        (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, ref_params, mb, denom)
        return aux, grads

    return grad_fn


def _both(model_config, lay):
    """jit(params, ref, mb, w_A) -> ((grads, losses [A], metrics [A]) padded, the same packed)."""

    def run(params, ref_params, mb, w_A):
        mask = mb.loss_mask
        n_tok, n_seq = mask.sum().astype(jnp.float32), mask.any(-1).sum().astype(jnp.float32)
        denom_A = jnp.stack([n_tok if a == "token-mean" else n_seq for a in losses.AGG_MODES])
        denom = (denom_A, w_A)
        (loss, metrics), grads = _grad_fn(model_config, None)(params, ref_params, mb, denom)
        packed = packing.accumulate(_grad_fn(model_config, lay), params, ref_params, mb, denom, lay)
        return (grads, loss, metrics), packed

    return jax.jit(run)


# Qwen3's q/k norms and tied head run the same packing code: its variant is marked slow.
@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny_qwen3", marks=pytest.mark.slow)])
def test_packed_equals_padded_for_every_aggregation_and_estimator(preset):
    """Loss, metrics and gradients to 1e-5, over several micro-batches of shared-prompt rows."""
    model_config = models.get_config(preset)
    params = models.init_params(model_config, jax.random.key(0))
    ref_params = jax.tree.map(lambda x: x * 1.01, params)  # a KL term that is not zero
    lay = _layout(_config(budget=2 * (TP + N)), model_config, TP)
    assert lay.rows == 2 and lay.share_prompt
    mb, rewards_PG = _rollout(seed=1)
    run = _both(model_config, lay)
    n_micro = packing.plan(
        lay, mb.prompt_lengths, packing.loss_span(mb.loss_mask.reshape(-1, N))
    ).num_micro
    assert int(n_micro) >= 3  # the accumulation runs over several micro-batches
    for name in advantages.names():
        adv_PG, _, _ = advantages.estimate(
            name, jnp.asarray(rewards_PG), advantages.init_eb_state(1)
        )
        assert float(jnp.abs(adv_PG).sum()) > 0, name
        for i, agg in enumerate(losses.AGG_MODES):
            w_A = jax.nn.one_hot(i, len(losses.AGG_MODES))
            padded, packed = run(params, ref_params, mb._replace(adv=adv_PG), w_A)
            msg = f"{name} {agg}"
            close = lambda a, b, msg=msg: np.testing.assert_allclose(
                a, b, rtol=1e-5, atol=1e-5, err_msg=msg
            )
            jax.tree.map(close, packed, padded)
            assert optax_norm(padded[0]) > 1e-3, msg  # gradients are not trivially zero


def optax_norm(tree):
    return jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in jax.tree.leaves(tree)))


@pytest.mark.slow  # the interpreted kernel compiles for a minute on a loaded CPU
def test_splash_packs_one_prompt_copy_per_sequence():
    """Under splash (interpreted on CPU) rows carry no prefix ids; log-probs equal the XLA
    padded path's."""
    config = models.get_config("tiny")
    params = models.init_params(config, jax.random.key(2))
    splash = config.replace(attention="splash")
    lay = _layout(_config(budget=256, row_len=128), splash, TP)
    assert not lay.share_prompt and lay.row_len == 128
    mb, _ = _rollout(seed=3)
    mask_BN = mb.loss_mask.reshape(-1, N)
    pl = packing.plan(lay, mb.prompt_lengths, packing.loss_span(mask_BN))
    assert int(pl.num_micro) == 1
    rows = packing.micro_batch(
        lay, pl, mb.prompt_tokens, mb.prompt_lengths, mb.tokens.reshape(-1, N), 0
    )
    assert "prefix_ids" not in rows
    logp = jax.jit(
        lambda p, r: packing.packed_completion_logprobs(
            splash, p, r, slots=(P * G, N), with_entropy=False
        )
    )(params, rows)
    ref = completion_logprobs(config, params, mb, with_entropy=False)
    np.testing.assert_allclose(np.where(mask_BN, logp, 0), np.where(mask_BN, ref, 0), atol=1e-5)


def _visible(rows, r, t):
    """Slots of row r that query slot t attends (forward's mask, computed by hand)."""
    seg, pre = rows["segment_ids"][r], rows.get("prefix_ids", rows["segment_ids"])[r]
    return [s for s in range(t + 1) if seg[s] == seg[t] or seg[s] == pre[t]]


def _check_plan(lay, prompt_PT, plen_P, comp_BN, span_B):
    pl = jax.jit(packing.plan, static_argnums=0)(lay, plen_P, span_B)
    row_B, start_B, pstart_B = (np.asarray(x) for x in (pl.row_B, pl.start_B, pl.prefix_start_B))
    plen_P, span_B, L = np.asarray(plen_P), np.asarray(span_B), lay.row_len
    # Pieces lie inside one row and never overlap; rows used are 0 .. used-1.
    pieces = [(s, n) for s, n in zip(start_B, span_B) if s >= 0]
    pieces += [(s, n) for s, n in zip(pstart_B, np.asarray(pl.prefix_len_B)) if s >= 0]
    assert all(s // L == (s + n - 1) // L for s, n in pieces)
    fill = np.zeros(lay.num_rows, int)
    for s, n in pieces:
        fill[s // L] += n
    assert fill.max() <= L
    covered = np.zeros(lay.num_rows * L, int)
    for s, n in pieces:
        covered[s : s + n] += 1
    assert covered.max() <= 1
    used = int((fill > 0).sum())
    assert (fill[:used] > 0).all() and int(pl.num_micro) == -(-used // lay.rows)
    assert ((row_B >= 0) == (span_B > 0)).all()
    # Every loss slot is predicted exactly once, from the right context at the right positions.
    seen = np.zeros(comp_BN.shape, int)
    for u in range(int(pl.num_micro)):
        rows = jax.tree.map(np.asarray, MICRO_BATCH(lay, pl, prompt_PT, plen_P, comp_BN, u))
        for r, t in zip(*np.nonzero(rows["dest"] < comp_BN.size)):
            b, n = divmod(int(rows["dest"][r, t]), comp_BN.shape[1])
            p = b // lay.group_size
            seen[b, n] += 1
            vis = _visible(rows, r, t)
            context = np.concatenate([prompt_PT[p, : plen_P[p]], comp_BN[b, :n]])
            np.testing.assert_array_equal(rows["tokens"][r, vis], context)
            np.testing.assert_array_equal(rows["positions"][r, vis], np.arange(len(context)))
            assert rows["targets"][r, t] == comp_BN[b, n]
            segs = rows["segment_ids"][r]
            # Segments are contiguous runs of slots.
            assert (np.nonzero(segs == segs[t])[0] == np.arange(*_run(segs, t))).all()
    np.testing.assert_array_equal(seen, np.arange(comp_BN.shape[1]) < span_B[:, None])
    return used


def _run(segs, t):
    lo = t
    while lo > 0 and segs[lo - 1] == segs[t]:
        lo -= 1
    hi = t
    while hi + 1 < len(segs) and segs[hi + 1] == segs[t]:
        hi += 1
    return lo, hi + 1


@pytest.mark.parametrize("share", [True, False])
def test_planner_places_every_token_once_within_rows(share):
    Pn, Gn, Tp, Nn = 5, 4, 6, 9
    model = models.get_config("tiny", attention="xla" if share else "splash")
    for seed, (budget, row_len) in enumerate([(45, 0), (60, 20), (15, 0)]):
        lay = _layout(_config(budget, row_len, P=Pn, G=Gn, N=Nn), model, Tp)
        rng = np.random.default_rng(seed)
        plen_P = rng.integers(1, Tp + 1, Pn)
        span_B = rng.integers(0, Nn + 1, Pn * Gn)
        span_B[rng.random(Pn * Gn) < 0.2] = Nn
        prompt = rng.integers(1, 99, (Pn, Tp))
        comp = rng.integers(1, 99, (Pn * Gn, Nn))
        used = _check_plan(lay, prompt, plen_P, comp, span_B)
        real = span_B.sum() + ((plen_P - 1) * (span_B.reshape(Pn, Gn) > 0).any(1)).sum()
        if share:  # shared prompts: rows hold at most the real tokens plus prompt copies
            assert used * lay.row_len >= real


def test_loss_span_is_up_to_the_last_masked_token():
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 1, 0, 1]], bool)
    np.testing.assert_array_equal(packing.loss_span(mask), [2, 0, 4])


def test_empty_minibatch_runs_no_micro_batch():
    lay = _layout(_config(budget=2 * (TP + N)), models.get_config("tiny"), TP)
    pl = packing.plan(lay, jnp.full((P,), 3), jnp.zeros((P * G,), jnp.int32))
    assert int(pl.num_micro) == 0 and (np.asarray(pl.row_B) == -1).all()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tokens_per_microbatch": -1}, "loss.tokens_per_microbatch must be >= 0"),
        ({"pack_row_len": 32}, "needs loss.tokens_per_microbatch > 0"),
        ({"tokens_per_microbatch": 64, "num_microbatches": 2}, "use num_microbatches=1"),
        ({"tokens_per_microbatch": 64, "pack_row_len": 4}, "must exceed sampler.max_new_tokens"),
        ({"tokens_per_microbatch": 20, "pack_row_len": 40}, "must hold one row"),
    ],
)
def test_bad_packing_fields_are_config_errors(changes, message):
    c = _config(0)
    c.prompts_per_step = 4
    for k, v in changes.items():
        c.loss[k] = v
    with pytest.raises(ConfigError, match=message):
        validate(c)


def test_layout_checks_the_prompt_width_and_shards():
    tiny = models.get_config("tiny")
    with pytest.raises(ConfigError, match="loss.pack_row_len=10 is shorter"):
        _layout(_config(100, row_len=10), tiny, TP)
    with pytest.raises(ConfigError, match="needs at least 8"):
        _layout(_config(3 * (TP + N)), tiny, TP, batch_shards=8)
    lay = _layout(_config(20 * (TP + N)), tiny, TP, batch_shards=8)
    assert lay.rows == 16 and lay.num_micro == 1  # capped at B = 12 rows, rounded to 8s
    assert _layout(_config(0), tiny, TP) is None


def test_chunked_head_equals_whole_head():
    """loss.logits_chunk over the flattened rows (padded to a multiple of the chunk)."""
    config = models.get_config("tiny_qwen3")
    params = models.init_params(config, jax.random.key(4))
    lay = _layout(_config(budget=3 * (TP + N)), config, TP)
    mb, _ = _rollout(seed=5)
    pl = packing.plan(lay, mb.prompt_lengths, packing.loss_span(mb.loss_mask.reshape(-1, N)))
    rows = MICRO_BATCH(lay, pl, mb.prompt_tokens, mb.prompt_lengths, mb.tokens.reshape(-1, N), 0)
    run = jax.jit(
        lambda p, r, chunk, ent: packing.packed_completion_logprobs(
            config, p, r, slots=(P * G, N), with_entropy=ent, chunk_size=chunk
        ),
        static_argnums=(2, 3),
    )
    whole = run(params, rows, 0, True)
    assert (TP + N) * lay.rows % 4  # the flattened rows need padding to chunks of 4
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), run(params, rows, 4, True), whole
    )
    np.testing.assert_allclose(run(params, rows, 4, False), whole[0], atol=1e-6)
