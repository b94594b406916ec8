"""Multi-turn episodes in the update: observation tokens get no loss, KL or entropy and are in no
normaliser, checked against a float64 numpy reference that drops them, padded and packed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import micro
from ebpo_jax import losses, models
from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import model_config_from
from ebpo_jax.trainer import make_update_fn
from ebpo_jax.trainer.state import init_train_state, make_optimizer

P, G, N, TP, VOCAB = 2, 2, 12, 5, 24
# Episodes: (prompt length, completion length, observation spans [start, end) in the completion).
EPISODES = [
    (5, 12, [(3, 6), (8, 10)]),  # three model turns, two observations, truncated at N
    (3, 9, [(2, 5)]),
    (4, 4, []),  # a single-turn row
    (5, 7, [(1, 4)]),
]


def _config(agg, budget):
    c = micro.get_config()
    c.unlock()
    c.prompts_per_step, c.group_size = P, G
    c.sampler.max_new_tokens = N
    c.loss.agg, c.loss.kl_coef, c.loss.entropy_coef = agg, 0.1, 0.01
    c.loss.tokens_per_microbatch = budget
    c.estimator = "grpo"
    return c


def _episode(mc, params):
    """A hand-built rollout: tokens, observation mask, off-policy old log-probs, advantages."""
    rng = np.random.default_rng(0)
    prompt_PT = np.zeros((P, TP), np.int32)
    tokens_BN, mask_BN = np.zeros((P * G, N), np.int32), np.zeros((P * G, N), bool)
    lengths = []
    for b, (lp, n, obs) in enumerate(EPISODES):
        if b % G == 0:
            prompt_PT[b // G, :lp] = rng.integers(3, VOCAB, lp)
        tokens_BN[b, :n] = rng.integers(3, VOCAB, n)
        mask_BN[b, :n] = True
        for s, e in obs:
            mask_BN[b, s:e] = False
        lengths.append(n)
    plen_P = np.array([EPISODES[p * G][0] for p in range(P)], np.int32)
    old_BN = np.where(np.arange(N) < np.array(lengths)[:, None], -3.0, 0.0)
    old_BN = old_BN + rng.normal(0, 0.3, old_BN.shape)
    return Rollout(
        prompt_tokens=jnp.asarray(prompt_PT),
        prompt_lengths=jnp.asarray(plen_P),
        answer_tokens=jnp.zeros((P, 1), jnp.int32),
        answer_lengths=jnp.ones((P,), jnp.int32),
        index=jnp.arange(P, dtype=jnp.int32),
        cluster_ids=jnp.zeros((P,), jnp.int32),
        tokens=jnp.asarray(tokens_BN.reshape(P, G, N)),
        logprobs=jnp.asarray(old_BN.reshape(P, G, N), jnp.float32),
        lengths=jnp.asarray(np.array(lengths, np.int32).reshape(P, G)),
        rewards=jnp.asarray([[1.0, 0.0], [0.0, 1.0]]),
        group_valid=jnp.ones((P,), bool),
        generated_tokens=jnp.int32(sum(lengths)),
        all_same_frac=jnp.float32(0),
        action_mask=jnp.asarray(mask_BN.reshape(P, G, N)),
    )


def _full_logits(mc, params, ro):
    """float64 logits [B, N, V] predicting each completion token, from one plain forward of
    prompt + whole episode per row (observations included as context), right-padded."""
    rows, T = [], TP + N
    for b in range(P * G):
        p, lp = b // G, int(ro.prompt_lengths[b // G])
        seq = np.concatenate([np.asarray(ro.prompt_tokens[p, :lp]), ro.tokens.reshape(-1, N)[b]])
        rows.append(np.pad(seq, (0, T - len(seq))))
    n_B = np.asarray(ro.lengths).reshape(-1)
    plen_B = np.repeat(np.asarray(ro.prompt_lengths), G)
    mask = np.arange(T)[None] < (plen_B + n_B)[:, None]
    logits = np.asarray(models.forward(mc, params, jnp.asarray(np.stack(rows)), mask=mask))
    out = np.zeros((P * G, N, mc.vocab_size))
    for b in range(P * G):
        lp, n = plen_B[b], n_B[b]
        out[b, :n] = logits[b, lp - 1 : lp - 1 + n].astype(np.float64)
    return out


def _reference(agg, ro, logits, ref_logits, adv_B):
    """Loss terms in float64 numpy over action tokens only."""
    lsm = lambda x: (
        x
        - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - (x.max(-1, keepdims=True))
    )
    tok = np.asarray(ro.tokens).reshape(-1, N)
    pick = lambda lg: np.take_along_axis(lsm(lg), tok[..., None], -1)[..., 0]
    logp, ref = pick(logits), pick(ref_logits)
    ent = -(np.exp(lsm(logits)) * lsm(logits)).sum(-1)
    act = np.asarray(ro.action_mask).reshape(-1, N) & (
        np.arange(N) < np.asarray(ro.lengths).reshape(-1, 1)
    )
    ratio = np.exp(logp - np.asarray(ro.logprobs, np.float64).reshape(-1, N))
    A = adv_B[:, None]
    pg = np.maximum(-A * ratio, -A * np.clip(ratio, 0.8, 1.2))
    neg = ref - logp
    kl = np.exp(neg) - neg - 1

    def reduce(x):
        rows = [x[b][act[b]] for b in range(len(x))]  # observation tokens dropped
        if agg == "token-mean":
            return sum(r.sum() for r in rows) / sum(r.size for r in rows)
        seqs = [r for r in rows if r.size]
        if agg == "seq-mean-token-mean":
            return sum(r.mean() for r in seqs) / len(seqs)
        total = sum(r.sum() for r in seqs) / len(seqs)
        return total / N if agg == "seq-mean-token-sum-norm" else total

    out = {"actor/pg_loss": reduce(pg), "actor/kl": reduce(kl), "actor/entropy": reduce(ent)}
    out["actor/loss"] = out["actor/pg_loss"] + 0.1 * out["actor/kl"] - 0.01 * out["actor/entropy"]
    return out


@pytest.fixture(scope="module")
def setup():
    c = _config("token-mean", 0)
    mc = model_config_from(resolve(c).task.model, VOCAB)
    params = models.init_params(mc, jax.random.key(0))
    ref_params = jax.tree.map(lambda x: x * 1.05, params)
    ro = _episode(mc, params)
    return (
        mc,
        params,
        ref_params,
        ro,
        _full_logits(mc, params, ro),
        _full_logits(mc, ref_params, ro),
    )


def _run(setup, agg, budget):
    mc, params, ref_params, ro, _, _ = setup
    spec = resolve(_config(agg, budget))
    opt = make_optimizer(spec.optim)
    state = init_train_state(jax.tree.map(jnp.copy, params), opt, seed=0, with_ref=True)
    state = state._replace(ref_params=ref_params)
    _, m = jax.jit(make_update_fn(spec.update, mc, opt, eos_id=2))(state, ro)
    return m


CASES = [(a, b) for a in losses.AGG_MODES for b in (0, 24)]
FAST = {("seq-mean-token-mean", 24)}  # packed, per-sequence token counts


@pytest.mark.parametrize(
    "agg,budget",
    [c if c in FAST else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
)
def test_observation_tokens_are_out_of_the_loss(setup, agg, budget):
    """Every aggregation mode, padded (budget 0) and packed: the update's loss, KL and entropy
    equal a float64 reference over action tokens, with log-probs across turn boundaries."""
    _, _, _, ro, logits, ref_logits = setup
    m = _run(setup, agg, budget)
    adv_B = np.asarray(_advantages(ro)).reshape(-1)
    want = _reference(agg, ro, logits, ref_logits, adv_B)
    for k, v in want.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=2e-4, atol=2e-6, err_msg=k)


def _advantages(ro):
    """GRPO's advantages of the rewards (the estimator the config runs)."""
    r = np.asarray(ro.rewards, np.float64)
    return (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)


def test_observation_mask_changes_the_loss(setup):
    """The reference itself is sensitive: with observations counted as actions the loss moves."""
    _, _, _, ro, logits, ref_logits = setup
    adv_B = np.asarray(_advantages(ro)).reshape(-1)
    full = ro._replace(action_mask=jnp.ones_like(ro.action_mask))
    a = _reference("token-mean", ro, logits, ref_logits, adv_B)
    b = _reference("token-mean", full, logits, ref_logits, adv_B)
    assert abs(a["actor/loss"] - b["actor/loss"]) > 1e-3
