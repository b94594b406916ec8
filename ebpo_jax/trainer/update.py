"""The update half of a step, as pure functions: advantages, then PPO epochs x mini-batches x
micro-batches (gradient accumulation) with optax."""

import functools

import jax
import jax.numpy as jnp
import optax

from ebpo_jax import advantages, importance, losses, models, sharding
from ebpo_jax.models import attention
from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.spec import UpdateSpec
from ebpo_jax.trainer import packing
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer.batch import MicroBatch, sum_micro
from ebpo_jax.trainer.state import TrainState

METRIC_DEFAULTS = ("eb/shrinkage_mean", "eb/mu_glob", "eb/sigma2", "eb/tau2")
_ROUTER = ("router/lb_loss", "router/load_max", "router/entropy")
_MISMATCH_MEANS = ("mismatch/abs_diff_mean", "mismatch/k3_kl", "mismatch/ratio_out_frac")
_TOKEN_WEIGHTED = (
    "actor/clip_frac_low",
    "actor/clip_frac_high",
    "actor/cov_frac",
    *_ROUTER,
    *_MISMATCH_MEANS,
)


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
    model_config, params, mb: MicroBatch, *, with_entropy, chunk_size=0, with_router=False
):
    """Per-token log-probs [B, N] (and entropy) of each completion of a padded MicroBatch given
    its prompt; `with_router`: also router metrics averaged over the sparse layers (of the
    completion tokens, or under splash of the packed prompt and completion tokens).

    Completions ([P, G, N] or [B, N]) continue prompt b in rows b*G .. b*G+G-1 (G = B / P;
    G = 1 for one prompt per row). The prompt runs once per group (`forward_grouped`); the
    splash kernel, which only does self-attention, gets packed rows instead. Mixture of
    experts: `mb.routing` (the sampler's, as [P, G, ...]) replays its experts (not under splash).
    """
    prompt_PTp, prompt_len_P, routing = mb.prompt_tokens, mb.prompt_lengths, mb.routing
    N = mb.tokens.shape[-1]
    comp_BN, comp_len_B = mb.tokens.reshape(-1, N), mb.lengths.reshape(-1)
    P, B = prompt_PTp.shape[0], comp_BN.shape[0]
    G = B // P
    router = {"with_router": True} if with_router else {}
    if attention.resolve(model_config.attention) == "splash":
        if routing is not None:
            raise ValueError(
                "routing replay in the padded forward (the padded update, the old-log-prob "
                "recompute) needs attention 'xla' or 'cudnn'"
            )
        prompt_BTp, prompt_len_B = jnp.repeat(prompt_PTp, G, 0), jnp.repeat(prompt_len_P, G, 0)
        tokens_BT, mask_BT = pack_sequences(prompt_BTp, prompt_len_B, comp_BN, comp_len_B)
        out = models.forward(
            model_config, params, tokens_BT, mask=mask_BT, return_hidden=True, **router
        )
        hidden_BTD, route = out if with_router else (out, None)
        # The hidden state at slot L-1+n predicts completion token n.
        idx_BN = jnp.minimum(
            prompt_len_B[:, None] - 1 + jnp.arange(N)[None], tokens_BT.shape[1] - 1
        )
        h_BND = jnp.take_along_axis(hidden_BTD, idx_BN[..., None], axis=1)
    else:
        out = models.forward_grouped(
            model_config,
            params,
            models.GroupedRows(prompt_PTp, prompt_len_P, comp_BN, comp_len_B),
            return_hidden=True,
            routing=_replay_layout(routing),
            **router,
        )
        route = out[2][1] if with_router else None  # the completions' tokens
        h_BND = _shift(out[0], out[1], prompt_len_P, G)
    result = _head_logprobs(model_config, params, h_BND, comp_BN, with_entropy, chunk_size)
    return (result, _router_metrics(route)) if with_router else result


def _replay_layout(routing):
    """Recorded routing [P, G, layers, T, k] as forward_grouped's (prompt, completion) replay."""
    if routing is None:
        return None
    to_layers = lambda x: x.reshape(-1, *x.shape[-3:]).transpose(1, 0, 2, 3)
    return to_layers(routing["prompt"][:, 0]), to_layers(routing["comp"])


def _shift(h_PTD, h_BND, prompt_len_P, G):
    """The hidden state before each completion token: the prompt's last, then token n-1's."""
    last_P1D = jnp.take_along_axis(h_PTD, (prompt_len_P - 1)[:, None, None], axis=1)
    return jnp.concatenate([jnp.repeat(last_P1D, G, 0), h_BND[:, :-1]], axis=1)


def _head_logprobs(model_config, params, h_BND, comp_BN, with_entropy, chunk_size):
    """Log-probs [B, N] (and entropies) of comp_BN from the hidden states before each token."""
    if model_config.batch_invariant:  # row blocks bound the logits held: no chunks needed
        return models.head_logprobs(model_config, params, h_BND, comp_BN, with_entropy)
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


def logprobs(
    spec: UpdateSpec, model_config, params, mb: MicroBatch, *, with_entropy, with_router=False
):
    """Per-token log-probs [B, N] (and entropy, router metrics) of a padded or packed MicroBatch
    (packed: router metrics over the rows' prompt and completion tokens, as under splash)."""
    if mb.packed is None:
        return completion_logprobs(
            model_config,
            params,
            mb,
            with_entropy=with_entropy,
            chunk_size=spec.loss.logits_chunk,
            with_router=with_router,
        )
    N = spec.max_new_tokens
    out = packing.packed_completion_logprobs(
        model_config,
        params,
        mb.packed,
        slots=(mb.logprobs.size // N, N),
        with_entropy=with_entropy,
        chunk_size=spec.loss.logits_chunk,
        with_router=with_router,
    )
    return (out[0], _router_metrics(out[1])) if with_router else out


def _router_metrics(route):
    """The router stats averaged over the sparse layers, as update metrics."""
    return {f"router/{k}": jnp.mean(route[k]) for k in ("lb_loss", "load_max", "entropy")}


def _loss_fn(spec: UpdateSpec, model_config, params, frozen, mb: MicroBatch, denom):
    """One micro-batch's policy loss (normalised by the mini-batch's `denom`) and metrics.

    `params` are the trained weights, `frozen` the policy view's frozen ones (the KL reference).
    """
    N = spec.max_new_tokens
    view = policy_lib.Policy(model_config, spec.lora)
    moe = model_config.is_moe
    params_fwd = view.forward_params(params, frozen)
    out = logprobs(spec, model_config, params_fwd, mb, with_entropy=True, with_router=moe)
    (logp_BN, ent_BN), router = out if moe else (out, {})
    if spec.loss.entropy_coef == 0:
        ent_BN = jax.lax.stop_gradient(ent_BN)  # a metric only: spare its backward pass
    ref_BN = None
    if spec.loss.kl_coef > 0:
        ref_BN = jax.lax.stop_gradient(logprobs(spec, model_config, frozen, mb, with_entropy=False))
    mask_BN = mb.loss_mask.reshape(-1, N)
    is_w_BN = mb.is_weights.reshape(-1, N) if mb.is_weights is not None else None
    noise_BN = mb.noise.reshape(-1, N) if mb.noise is not None else None
    terms = losses.TokenTerms(
        logp_BN,
        mb.logprobs.reshape(-1, N),
        mb.adv.reshape(-1),
        mask_BN,
        ref_logp_BT=ref_BN,
        entropy_BT=ent_BN,
        is_weights_BT=is_w_BN,
        noise_BT=noise_BN,
    )
    loss, metrics = losses.policy_loss(
        terms, losses.LossOptions.from_config(spec.loss), denominator=denom
    )
    # Local token-mean metrics become exact mini-batch means once weighted by token share.
    share = mask_BN.sum() / jnp.maximum(mb.mb_tokens, 1.0)
    if spec.moe.lb_coef:
        loss = loss + spec.moe.lb_coef * share * router["router/lb_loss"]
    metrics = dict(metrics, **router)
    if exact_on_policy(spec, model_config):  # the sampler's log-probs are the old ones
        metrics.update(importance.mismatch_metrics(terms.old_logp_BT, logp_BN, mask_BN))
    metrics = {k: v * share if k in _TOKEN_WEIGHTED else v for k, v in metrics.items()}
    metrics.setdefault("actor/kl", jnp.zeros(()))
    return loss, metrics


def _scan_accumulate(U: int, grad_fn, params, frozen, mb: MicroBatch, denom):
    """(grads, loss, metrics) of a padded mini-batch summed over its U micro-batches (lax.scan).

    Every micro-batch is normalised by the whole mini-batch's denominator, so the sums are
    exactly the full mini-batch's loss, metrics and gradient.
    """
    micro = jax.tree.map(lambda x: x.reshape(U, x.shape[0] // U, *x.shape[1:]), mb)
    micro = micro._replace(mb_tokens=jnp.full((U,), mb.loss_mask.sum().astype(jnp.float32)))

    def step(acc, one):
        (loss, metrics), grads = grad_fn(params, frozen, one, denom)
        return jax.tree.map(jnp.add, acc, grads), (loss, metrics)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grads, (loss_U, metrics_U) = jax.lax.scan(step, zeros, micro, unroll=U == 1)
    return grads, loss_U.sum(), sum_micro(metrics_U)


def accumulate(spec: UpdateSpec, model_config, grad_fn, params, frozen, mb: MicroBatch, denom):
    """(grads, loss, metrics) of mini-batch `mb` summed over its micro-batches: U padded ones,
    or packed token rows (loss.tokens_per_microbatch > 0: packing.accumulate)."""
    width = mb.prompt_tokens.shape[1]
    shards = functools.partial(sharding.shards_of, rules=model_config.sharding_rules)
    lay = packing.layout(
        spec, model_config, width, batch_shards=shards("batch"), context=shards("seq")
    )
    if lay is None:
        return _scan_accumulate(spec.loss.num_microbatches, grad_fn, params, frozen, mb, denom)
    return packing.accumulate(grad_fn, params, frozen, mb, denom, lay)


def all_finite(tree) -> jax.Array:
    """Scalar bool: every float leaf of `tree` is finite (x * 0 is 0 for finite x, NaN else,
    so one sum per leaf and one `&` across leaves, fused by XLA into the update)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    sums = [jnp.sum(x * jnp.zeros((), x.dtype), dtype=jnp.float32) for x in leaves]
    return jnp.isfinite(sum(sums, jnp.zeros((), jnp.float32)))


def _minibatch_update(spec: UpdateSpec, model_config, grad_fn, optimizer, carry, mb):
    """One optimizer update on a mini-batch (`carry`: trained weights, their optimizer state,
    the frozen weights)."""
    params, opt_state, frozen = carry
    tok_mask = mb.loss_mask
    n_tok = tok_mask.sum().astype(jnp.float32)
    n_seq = tok_mask.any(-1).sum().astype(jnp.float32)
    denom = n_tok if spec.loss.agg == "token-mean" else n_seq
    grads, loss, metrics = accumulate(spec, model_config, grad_fn, params, frozen, mb, denom)
    grad_norm = optax.tree.norm(grads)
    updates, new_opt = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # A finite gradient can still overflow the update (a huge learning rate times weight
    # decay): the committed params and moments must be finite too, or a checkpoint is poisoned.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & all_finite((new_params, new_opt))
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    params, opt_state = keep(new_params, params), keep(new_opt, opt_state)
    metrics = dict(
        metrics, **{"actor/loss": loss, "actor/grad_norm": grad_norm, "skipped": ~finite}
    )
    return (params, opt_state, frozen), metrics


def _advantages(spec: UpdateSpec, eb_state, ro: Rollout, valid_PG):
    """Shaped rewards [P, G], advantages [P, G], the new EB state and estimator metrics."""
    shaped_PG = ro.rewards + overlong_penalty(
        ro.lengths, spec.max_new_tokens, spec.dapo.overlong_buffer, spec.dapo.overlong_penalty
    )
    adv_PG, eb_state, est_metrics = advantages.estimate(
        spec.run.estimator,
        shaped_PG,
        eb_state,
        mask=valid_PG,
        cluster_ids=ro.cluster_ids if spec.use_clusters else None,
        **spec.estimator_options.as_kwargs(),
    )
    return shaped_PG, adv_PG, eb_state, est_metrics


def _minibatches(spec: UpdateSpec, data, k_perm):
    """`data`'s P prompt groups in E shuffled orders, cut into E*M mini-batches."""
    P, E, M = spec.prompts, spec.loss.ppo_epochs, spec.loss.num_minibatches
    perms_EP = jax.vmap(lambda k: jax.random.permutation(k, P))(jax.random.split(k_perm, E))
    return jax.tree.map(
        lambda x: x[perms_EP.reshape(-1)].reshape(E * M, P // M, *x.shape[1:]), data
    )


def _with_noise(spec: UpdateSpec, batches: MicroBatch, k_perm) -> MicroBatch:
    """Fresh uniform draws per token and mini-batch for a surrogate that samples tokens."""
    if not losses.draws(spec.loss.name):
        return batches
    # fold_in, not split: the key stream (so every other loss's run) stays as it was.
    k_noise = jax.random.fold_in(k_perm, 0xC0F)
    return batches._replace(noise=jax.random.uniform(k_noise, batches.loss_mask.shape))


def exact_on_policy(spec: UpdateSpec, model_config) -> bool:
    """The batch-invariant mode without a recompute: the sampler's log-probs are the old ones,
    and mismatch/* is measured by the first mini-batch's own forward (issue 47)."""
    return model_config.batch_invariant and not spec.loss.recompute_old_logprobs


def _first_minibatch(upd: dict) -> dict:
    """The mismatch/* metrics of the first mini-batch, popped from the per-update `upd`: later
    ones compare an already updated policy with the sampler's."""
    return {k: upd.pop(k)[0] for k in list(upd) if k.startswith("mismatch/")}


def _recomputed_logprobs(spec: UpdateSpec, model_config, params, ro: Rollout):
    """The trainer's own log-probs [P, G, N] of the sampled tokens, one micro-batch of prompts
    at a time (lax.map), so no more activations live at once than in the update."""
    P, G, N = spec.prompts, spec.group_size, spec.max_new_tokens
    per = P // spec.loss.num_minibatches // spec.loss.num_microbatches
    split = lambda x: x.reshape(P // per, per, *x.shape[1:])

    def one(mb: MicroBatch):
        logp_BN = logprobs(spec, model_config, params, mb, with_entropy=False)
        return logp_BN.reshape(per, G, N)

    routing = ro.routing if spec.moe.routing_replay else None
    rows = MicroBatch(ro.prompt_tokens, ro.prompt_lengths, ro.tokens, ro.lengths, routing=routing)
    old_CPGN = jax.lax.map(one, jax.tree.map(split, rows))
    return jax.lax.stop_gradient(old_CPGN.reshape(P, G, N))


def _off_policy(spec: UpdateSpec, model_config, params, ro: Rollout, mask_PGN):
    """Old log-probs, loss mask and IS weights [P, G, N] from the trainer's own forward, with
    the sampler-vs-trainer mismatch and IS metrics (ebpo_jax.importance)."""
    P, G, N = spec.prompts, spec.group_size, spec.max_new_tokens
    old_PGN = _recomputed_logprobs(spec, model_config, params, ro)
    flat = lambda x: x.reshape(P * G, N)
    metrics = importance.mismatch_metrics(flat(ro.logprobs), flat(old_PGN), flat(mask_PGN))
    w_BN, mask_BN, is_metrics = importance.is_correction(
        flat(old_PGN),
        flat(ro.logprobs),
        flat(mask_PGN),
        mode=spec.loss.is_correction,
        level=spec.loss.is_level,
        cap=spec.loss.is_cap,
        low=spec.loss.is_low,
        high=spec.loss.is_high,
    )
    shape = lambda x: x.reshape(P, G, N)
    return old_PGN, shape(mask_BN), shape(w_BN), {**metrics, **is_metrics}


def _step_metrics(ro: Rollout, valid_PG, shaped_PG, adv_PG, trunc_PG, new_tokens):
    """Reward, advantage, length and throughput metrics of one step (valid groups only)."""
    nvalid = jnp.maximum(valid_PG.sum(), 1)
    vmean = lambda x: jnp.where(valid_PG, x, 0).sum() / nvalid
    r_mean = vmean(shaped_PG)
    return {
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
    }


SAMPLE_ADVANTAGES = "samples/advantages_G"  # the [G] advantages of the step's first prompt


def _loss_mask(spec: UpdateSpec, ro: Rollout, valid_PG, trunc_PG):
    """[P, G, N] bool: the tokens in the loss."""
    N = spec.max_new_tokens
    # Observation tokens of multi-turn episodes are context: out of every loss term and count.
    loss_mask_PGN = (jnp.arange(N) < ro.lengths[..., None]) & valid_PG[..., None] & ro.action_mask
    if spec.dapo.mask_truncated:
        loss_mask_PGN &= ~trunc_PG[..., None]
    return loss_mask_PGN


def _loss_batch(spec: UpdateSpec, model_config, state: TrainState, ro: Rollout, adv_PG, mask_PGN):
    """The whole rollout as one MicroBatch for the PPO epochs, and the off-policy metrics
    (old log-probs recomputed by the trainer, IS weights) when the spec asks for them."""
    data = MicroBatch(
        prompt_tokens=ro.prompt_tokens,
        prompt_lengths=ro.prompt_lengths,
        tokens=ro.tokens,
        lengths=ro.lengths,
        logprobs=ro.logprobs,
        adv=adv_PG,
        loss_mask=mask_PGN,
    )
    if spec.moe.routing_replay:
        if ro.routing is None:
            raise ValueError("model.moe.routing_replay: the rollout recorded no routing")
        data = data._replace(routing=ro.routing)
    if not spec.loss.recompute_old_logprobs:
        return data, {}
    view = policy_lib.Policy(model_config, spec.lora)
    params = view.forward_params(view.trained(state), view.frozen(state))
    old, mask, w, off_metrics = _off_policy(spec, model_config, params, ro, mask_PGN)
    data = data._replace(logprobs=old, loss_mask=mask)
    if spec.loss.is_correction != "none":
        data = data._replace(is_weights=w)
    return data, off_metrics


def update(spec: UpdateSpec, model_config, optimizer, eos_id, state: TrainState, ro: Rollout):
    """Advantages, then PPO epochs x mini-batches over the rollout: (new state, metrics)."""
    P, G = spec.prompts, spec.group_size
    key = jax.random.wrap_key_data(state.rng)
    key, k_perm = jax.random.split(key)
    # A non-finite reward (a broken verifier) is dropped: masked out of the estimator, its
    # state and the loss, and counted.
    finite_PG = jnp.isfinite(ro.rewards)
    ro = ro._replace(rewards=jnp.where(finite_PG, ro.rewards, 0.0))
    valid_PG = jnp.broadcast_to(ro.group_valid[:, None], (P, G)) & finite_PG
    shaped_PG, adv_PG, eb_state, est_metrics = _advantages(spec, state.eb_state, ro, valid_PG)
    trunc_PG = truncated(ro.tokens, ro.lengths, eos_id)
    mask_PGN = _loss_mask(spec, ro, valid_PG, trunc_PG)
    data, off_metrics = _loss_batch(spec, model_config, state, ro, adv_PG, mask_PGN)
    view = policy_lib.Policy(model_config, spec.lora)
    grad_fn = jax.value_and_grad(functools.partial(_loss_fn, spec, model_config), has_aux=True)
    (params, opt_state, _), upd = jax.lax.scan(
        functools.partial(_minibatch_update, spec, model_config, grad_fn, optimizer),
        (view.trained(state), state.opt_state, view.frozen(state)),
        _with_noise(spec, _minibatches(spec, data, k_perm), k_perm),
        unroll=spec.updates == 1,
    )
    skipped = upd.pop("skipped").sum()
    first = _first_minibatch(upd)
    # A step whose update was skipped leaves the EB statistics as they were, so one bad
    # batch cannot poison every later step's prior.
    eb_state = jax.tree.map(
        lambda new, old: jnp.where(skipped > 0, old, new), eb_state, state.eb_state
    )
    new_tokens = state.generated_tokens + ro.generated_tokens
    metrics = {k: v.mean() for k, v in upd.items()}
    metrics.update({k: jnp.zeros(()) for k in METRIC_DEFAULTS})
    metrics.update(est_metrics)
    metrics.update(off_metrics)
    metrics.update(first)
    metrics.update(_step_metrics(ro, valid_PG, shaped_PG, adv_PG, trunc_PG, new_tokens))
    metrics["train/skipped_updates"] = skipped
    metrics["reward/nonfinite_count"] = (~finite_PG).sum().astype(jnp.float32)
    nonfinite_run = jnp.where(skipped > 0, state.nonfinite_run + 1, 0)
    new_state = state._replace(
        params=params,
        opt_state=opt_state,
        eb_state=eb_state,
        step=state.step + 1,
        rng=jax.random.key_data(key),
        nonfinite_run=nonfinite_run,
        generated_tokens=new_tokens,
    )
    metrics["train/nonfinite_run"] = nonfinite_run
    # Not a scalar metric: the first prompt's advantages, for samples.jsonl (the loop pops it).
    metrics[SAMPLE_ADVANTAGES] = adv_PG[0]
    return new_state, metrics


def make_update_fn(spec: UpdateSpec, model_config, optimizer, eos_id):
    """update(state, rollout) -> (state, metrics); advantages then PPO epochs x mini-batches."""
    return functools.partial(update, spec, model_config, optimizer, eos_id)
