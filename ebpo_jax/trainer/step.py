"""One EBPO step as pure functions: advantages, the PPO update with accumulation, train_step."""

import jax
import jax.numpy as jnp
import optax

from ebpo_jax import advantages, losses, models
from ebpo_jax.trainer.rollout import Rollout, make_rollout_fn
from ebpo_jax.trainer.state import TrainState

METRIC_DEFAULTS = ("eb/shrinkage_mean", "eb/mu_glob", "eb/sigma2", "eb/tau2")
_TOKEN_WEIGHTED = ("actor/clip_frac_low", "actor/clip_frac_high")


def pack_sequences(prompt_BTp, prompt_len_B, comp_BN, comp_len_B):
    """Prompt then completion in one right-padded row: tokens [B, Tp+N] and mask."""
    Tp, N = prompt_BTp.shape[1], comp_BN.shape[1]
    t_T = jnp.arange(Tp + N)
    in_prompt_BT = t_T[None] < prompt_len_B[:, None]
    p_BT = jnp.pad(prompt_BTp, ((0, 0), (0, N)))
    c_idx_BT = jnp.clip(t_T[None] - prompt_len_B[:, None], 0, N - 1)
    c_BT = jnp.take_along_axis(comp_BN, c_idx_BT, 1)
    tokens_BT = jnp.where(in_prompt_BT, p_BT, c_BT)
    mask_BT = t_T[None] < (prompt_len_B + comp_len_B)[:, None]
    return tokens_BT, mask_BT


def completion_logprobs(
    model_config,
    params,
    prompt_PTp,
    prompt_len_P,
    comp_BN,
    comp_len_B,
    *,
    with_entropy,
    chunk_size=0,
):
    """Per-token log-probs [B, N] (and entropy) of each completion given its prompt.

    Completion rows b*G .. b*G+G-1 continue prompt b (G = B / P; G = 1 for one prompt per
    row). The prompt runs once per group (`forward_grouped`); the splash kernel, which only
    does self-attention, gets packed rows instead.
    """
    P, B = prompt_PTp.shape[0], comp_BN.shape[0]
    G, N = B // P, comp_BN.shape[1]
    if model_config.attention == "splash":
        prompt_BTp, prompt_len_B = jnp.repeat(prompt_PTp, G, 0), jnp.repeat(prompt_len_P, G, 0)
        tokens_BT, mask_BT = pack_sequences(prompt_BTp, prompt_len_B, comp_BN, comp_len_B)
        hidden_BTD = models.forward(
            model_config, params, tokens_BT, mask=mask_BT, return_hidden=True
        )
        # The hidden state at slot L-1+n predicts completion token n.
        idx_BN = jnp.minimum(
            prompt_len_B[:, None] - 1 + jnp.arange(N)[None], tokens_BT.shape[1] - 1
        )
        h_BND = jnp.take_along_axis(hidden_BTD, idx_BN[..., None], axis=1)
    else:
        h_PTD, h_BND = models.forward_grouped(
            model_config,
            params,
            prompt_PTp,
            prompt_len_P,
            comp_BN,
            comp_len_B=comp_len_B,
            return_hidden=True,
        )
        # The prompt's last token predicts completion token 0; completion token n-1, token n.
        last_P1D = jnp.take_along_axis(h_PTD, (prompt_len_P - 1)[:, None, None], axis=1)
        h_BND = jnp.concatenate([jnp.repeat(last_P1D, G, 0), h_BND[:, :-1]], axis=1)
    w_DV = models.output_embedding(model_config, params)
    if chunk_size:  # large vocabularies: never hold all [B, N, V] logits at once
        return losses.logprobs_from_hidden(
            h_BND, w_DV, comp_BN, chunk_size=chunk_size, with_entropy=with_entropy
        )
    logits_BNV = jnp.einsum("bnd,dv->bnv", h_BND, w_DV, preferred_element_type=jnp.float32)
    logp_BN = losses.token_logprobs(logits_BNV, comp_BN)
    return (logp_BN, losses.token_entropy(logits_BNV)) if with_entropy else logp_BN


def overlong_penalty(lengths, max_new_tokens: int, buffer: int, factor: float):
    """DAPO's soft length penalty: 0 up to max-buffer, then linear down to -factor at max."""
    if buffer <= 0:
        return jnp.zeros(lengths.shape, jnp.float32)
    over = lengths.astype(jnp.float32) - (max_new_tokens - buffer)
    return -factor * jnp.clip(over / buffer, 0.0, 1.0)


def truncated(tokens_PGN, lengths_PG, eos_id):
    """[P, G] bool: the response hit max_new_tokens without ending on a stop id (`eos_id`:
    one id or several, e.g. EOS and a chat template's end-of-turn)."""
    N = tokens_PGN.shape[-1]
    last_PG = jnp.take_along_axis(tokens_PGN, jnp.maximum(lengths_PG - 1, 0)[..., None], -1)[..., 0]
    return (lengths_PG >= N) & ~jnp.isin(last_PG, jnp.asarray(eos_id).reshape(-1))


def make_update_fn(config, model_config, optimizer, eos_id: int):
    """update(state, rollout) -> (state, metrics); advantages then PPO epochs x mini-batches."""
    P, G = config.prompts_per_step, config.group_size
    N = config.sampler.max_new_tokens
    lc = config.loss
    M, U, E = lc.num_minibatches, lc.num_microbatches, lc.ppo_epochs
    per_mb, per_micro = P // M, P // M // U
    est_options = dict(config.estimator_options)
    use_kl = lc.kl_coef > 0
    seq_agg = lc.agg != "token-mean"

    def loss_fn(params, ref_params, mb, denom):
        prompt_PTp, plen_P = mb["prompt_tokens"], mb["prompt_lengths"]
        comp_BN, clen_B = mb["tokens"].reshape(-1, N), mb["lengths"].reshape(-1)
        logp_BN, ent_BN = completion_logprobs(
            model_config,
            params,
            prompt_PTp,
            plen_P,
            comp_BN,
            clen_B,
            with_entropy=True,
            chunk_size=lc.logits_chunk,
        )
        if lc.entropy_coef == 0:
            ent_BN = jax.lax.stop_gradient(ent_BN)  # a metric only: spare its backward pass
        ref_BN = None
        if use_kl:
            ref_BN = jax.lax.stop_gradient(
                completion_logprobs(
                    model_config,
                    ref_params,
                    prompt_PTp,
                    plen_P,
                    comp_BN,
                    clen_B,
                    with_entropy=False,
                    chunk_size=lc.logits_chunk,
                )
            )
        mask_BN = mb["loss_mask"].reshape(-1, N)
        loss, metrics = losses.policy_loss(
            logp_BN,
            mb["logprobs"].reshape(-1, N),
            mb["adv"].reshape(-1),
            mask_BN,
            clip_low=lc.clip_low,
            clip_high=lc.clip_high,
            dual_clip=lc.dual_clip if lc.dual_clip > 0 else None,
            agg=lc.agg,
            ref_logp_BT=ref_BN,
            kl_coef=lc.kl_coef,
            kl_estimator=lc.kl_estimator,
            entropy_BT=ent_BN,
            entropy_coef=lc.entropy_coef,
            denominator=denom,
        )
        # Local token-mean metrics become exact mini-batch means once weighted by token share.
        share = mask_BN.sum() / jnp.maximum(mb["mb_tokens"], 1.0)
        metrics = {k: v * share if k in _TOKEN_WEIGHTED else v for k, v in metrics.items()}
        metrics.setdefault("actor/kl", jnp.zeros(()))
        return loss, metrics

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def minibatch_update(carry, mb):
        params, opt_state, ref_params = carry
        tok_mask = mb["loss_mask"]
        n_tok = tok_mask.sum().astype(jnp.float32)
        n_seq = tok_mask.any(-1).sum().astype(jnp.float32)
        denom = n_seq if seq_agg else n_tok
        micro = jax.tree.map(lambda x: x.reshape(U, per_micro, *x.shape[1:]), mb)
        micro["mb_tokens"] = jnp.full((U,), n_tok)

        def accumulate(acc, one):
            (loss, metrics), grads = grad_fn(params, ref_params, one, denom)
            return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

        # Every micro-batch is normalised by the whole mini-batch's denominator, so the sums
        # below are exactly the full mini-batch's loss, metrics and gradient.
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grads, (loss_U, metrics_U) = jax.lax.scan(accumulate, zeros, micro, unroll=U == 1)
        loss, metrics = loss_U.sum(), {k: v.sum() for k, v in metrics_U.items()}
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
        params, opt_state = keep(new_params, params), keep(new_opt, opt_state)
        metrics = dict(
            metrics, **{"actor/loss": loss, "actor/grad_norm": grad_norm, "skipped": ~finite}
        )
        return (params, opt_state, ref_params), metrics

    def update(state: TrainState, ro: Rollout):
        key = jax.random.wrap_key_data(state.rng)
        key, k_perm = jax.random.split(key)
        valid_PG = jnp.broadcast_to(ro.group_valid[:, None], (P, G))
        shaped_PG = ro.rewards + overlong_penalty(
            ro.lengths, N, config.dapo.overlong_buffer, config.dapo.overlong_penalty
        )
        adv_PG, eb_state, est_metrics = advantages.estimate(
            config.estimator,
            shaped_PG,
            state.eb_state,
            mask=valid_PG,
            cluster_ids=ro.cluster_ids if config.eb_clusters != "none" else None,
            **est_options,
        )
        trunc_PG = truncated(ro.tokens, ro.lengths, eos_id)
        loss_mask_PGN = (jnp.arange(N) < ro.lengths[..., None]) & valid_PG[..., None]
        if config.dapo.mask_truncated:
            loss_mask_PGN &= ~trunc_PG[..., None]
        data = {
            "prompt_tokens": ro.prompt_tokens,
            "prompt_lengths": ro.prompt_lengths,
            "tokens": ro.tokens,
            "lengths": ro.lengths,
            "logprobs": ro.logprobs,
            "adv": adv_PG,
            "loss_mask": loss_mask_PGN,
        }
        perms_EP = jax.vmap(lambda k: jax.random.permutation(k, P))(jax.random.split(k_perm, E))
        mbs = jax.tree.map(
            lambda x: x[perms_EP.reshape(-1)].reshape(E * M, per_mb, *x.shape[1:]), data
        )
        (params, opt_state, _), upd = jax.lax.scan(
            minibatch_update,
            (state.params, state.opt_state, state.ref_params),
            mbs,
            unroll=E * M == 1,
        )
        skipped = upd.pop("skipped").sum()
        new_tokens = state.generated_tokens + ro.generated_tokens
        nvalid = jnp.maximum(valid_PG.sum(), 1)
        vmean = lambda x: jnp.where(valid_PG, x, 0).sum() / nvalid
        r_mean = vmean(shaped_PG)
        metrics = {k: v.mean() for k, v in upd.items()}
        metrics.update({k: jnp.zeros(()) for k in METRIC_DEFAULTS})
        metrics.update(est_metrics)
        metrics.update(
            {
                "reward/mean": r_mean,
                "reward/std": jnp.sqrt(vmean((shaped_PG - r_mean) ** 2)),
                "reward/pass_rate": vmean(ro.rewards),
                "adv/zero_frac": vmean(adv_PG == 0),
                "adv/all_same_group_frac": ro.all_same_frac,
                "response_length/mean": vmean(ro.lengths),
                "response_length/truncated_frac": vmean(trunc_PG),
                "perf/generated_tokens_total": new_tokens,
                "perf/step_tokens": ro.generated_tokens,
                "train/valid_group_frac": ro.group_valid.mean(),
                "train/skipped_updates": skipped,
            }
        )
        bad = skipped > 0
        new_state = TrainState(
            params=params,
            opt_state=opt_state,
            eb_state=eb_state,
            step=state.step + 1,
            rng=jax.random.key_data(key),
            ref_params=state.ref_params,
            nonfinite_run=jnp.where(bad, state.nonfinite_run + 1, 0),
            generated_tokens=new_tokens,
        )
        metrics["train/nonfinite_run"] = new_state.nonfinite_run
        return new_state, metrics

    return update


def make_train_step(config, model_config, optimizer, reward_fn, eos_id: int, *, mesh=None):
    """train_step(state, batch) -> (state, metrics): a pure lax.scan body."""
    rollout = make_rollout_fn(config, model_config, reward_fn, eos_id, mesh)
    update = make_update_fn(config, model_config, optimizer, eos_id)

    def train_step(state: TrainState, batch):
        key = jax.random.wrap_key_data(state.rng)
        ro = rollout(state.params, batch, jax.random.fold_in(key, 1))
        return update(state, ro)

    return train_step


def make_multi_step(train_step):
    """K steps in one lax.scan over a batch stacked on a leading [K] axis."""

    def multi_step(state, batches):
        return jax.lax.scan(train_step, state, batches)

    return multi_step
