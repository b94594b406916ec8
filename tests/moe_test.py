"""Qwen3-MoE: transformers parity, cached/grouped paths, grouped matmuls, sharding, LoRA, router."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import forward_cached
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models, sharding
from ebpo_jax.models import gmm, lora, moe

# Small shapes for every test: 8 experts of width 16, hidden 32, vocab 64.
SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "moe_intermediate_size": 16,
    "head_dim": 8,
}


def _config(preset="tiny_moe_mixed", **overrides):
    return models.get_config(preset, **{**SMALL, **overrides})


def _hf_model(tmp_path, **kw):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    fields = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 24,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_experts": 5,
        "num_experts_per_tok": 2,
    }
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**fields, **kw})).eval()
    # transformers' init draws std-0.02 routers: nearly uniform routing. Sharper routers make
    # the choice of experts matter to the logits, which is what parity must check.
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 1.0)
    hf.save_pretrained(tmp_path)
    return hf


LAYOUTS = {
    "odd_experts_k2": {"num_experts": 5, "num_experts_per_tok": 2},
    "k1_normed": {"num_experts": 3, "num_experts_per_tok": 1, "norm_topk_prob": True},
    "mixed": {
        "num_experts": 7,
        "num_experts_per_tok": 3,
        "decoder_sparse_step": 2,
        "norm_topk_prob": True,
    },
    "dense_first": {"mlp_only_layers": [0], "num_experts": 4, "num_experts_per_tok": 4},
}


# The mixed layout (dense and sparse runs, odd expert count, k=3) in the default suite.
@pytest.mark.parametrize(
    "layout", [n if n == "mixed" else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS]
)
def test_logits_match_transformers_and_round_trip(layout, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = _hf_model(tmp_path / "hf", **LAYOUTS[layout])
    config, params = models.from_hf(str(tmp_path / "hf"))
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert [k == "moe" for k in config.layer_kinds] == sparse
    tokens = np.random.default_rng(0).integers(0, 64, (2, 11))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(models.forward(config, params, jnp.asarray(tokens)), ref, atol=1e-4)
    models.to_hf(config, params, str(tmp_path / "out"))
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        np.testing.assert_array_equal(back(torch.tensor(tokens)).logits.numpy(), ref)


def test_router_is_hf_topk_softmax_in_float64():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(6, 5))
    for norm in (False, True):
        w, e, _ = moe.route(jnp.asarray(logits, jnp.float32), 2, norm)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        top = np.argsort(-p, axis=-1)[:, :2]
        want = np.take_along_axis(p, top, -1)
        want = want / want.sum(-1, keepdims=True) if norm else want
        np.testing.assert_array_equal(e, top)
        np.testing.assert_allclose(w, want, rtol=1e-6)


def test_router_stats_match_numpy():
    rng = np.random.default_rng(2)
    probs = rng.dirichlet(np.ones(4), size=10)
    experts = np.argsort(-probs, -1)[:, :2]
    mask = np.arange(10) < 7
    got = moe.router_stats(jnp.asarray(probs), jnp.asarray(experts), jnp.asarray(mask))
    f = np.bincount(experts[mask].ravel(), minlength=4) / (7 * 2)
    pe = probs[mask].mean(0)
    np.testing.assert_allclose(got["lb_loss"], 4 * np.sum(f * pe), rtol=1e-6)
    np.testing.assert_allclose(got["load_max"], f.max() * 4, rtol=1e-6)
    ent = -(probs[mask] * np.log(probs[mask])).sum(-1).mean()
    np.testing.assert_allclose(got["entropy"], ent, rtol=1e-6)


@pytest.mark.slow
def test_prefill_and_decode_match_forward_with_routes():
    config = _config()
    assert config.layer_kinds == ("dense", "moe", "dense", "moe")
    params = models.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, config.vocab_size)
    ref, route = models.forward(config, params, tokens, with_router=True)
    assert route["experts"].shape == (2, 2, 9, 2) and route["experts"].dtype == jnp.uint8
    T = 6
    last, cache, r_pre = models.prefill(
        config,
        params,
        tokens[:, :T],
        mask=jnp.ones((2, T), bool),
        cache_size=9,
        logits_at=jnp.full((2,), T - 1),
        with_router=True,
    )
    np.testing.assert_allclose(last, ref[:, T - 1], atol=1e-5)
    np.testing.assert_array_equal(r_pre["experts"], route["experts"][:, :, :T])
    layers = models.split_layers(config, params)
    for t in range(T, 9):
        out, cache, r_t = forward_cached(
            config,
            params,
            tokens[:, t : t + 1],
            jnp.full((2, 1), t),
            cache,
            start=jnp.int32(t),
            kv_len_B=jnp.full((2,), t + 1),
            layers=layers,
            with_router=True,
        )
        np.testing.assert_allclose(out[:, 0], ref[:, t], atol=1e-5)
        np.testing.assert_array_equal(r_t["experts"], route["experts"][:, :, t : t + 1])


@pytest.mark.slow
def test_forward_grouped_matches_forward_and_replays():
    config = _config()
    params = models.init_params(config, jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (1, 5), 0, config.vocab_size)
    comp = jax.random.randint(jax.random.key(2), (2, 4), 0, config.vocab_size)
    rows = models.GroupedRows(prompt, jnp.array([5]), comp)
    _p_out, c_out, (r_p, r_c) = models.forward_grouped(config, params, rows, with_router=True)
    full = jnp.concatenate([jnp.repeat(prompt, 2, 0), comp], axis=1)
    ref, route = models.forward(config, params, full, with_router=True)
    np.testing.assert_allclose(c_out, ref[:, 5:], atol=1e-5)
    np.testing.assert_array_equal(r_c["experts"], route["experts"][:, :, 5:])
    np.testing.assert_array_equal(r_p["experts"][:, 0], route["experts"][:, 0, :5])
    # Replaying the recorded experts reproduces the outputs exactly.
    again = models.forward_grouped(config, params, rows, routing=(r_p["experts"], r_c["experts"]))
    np.testing.assert_array_equal(again[1], c_out)


def test_megablox_gmm_matches_ragged_dot_values_and_grads():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(50, 24)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 24, 40)), jnp.float32)
    sizes = jnp.array([10, 0, 17, 3, 20])  # an empty group, ragged tile edges

    def loss(impl, x, w):
        return jnp.sum(jnp.sin(gmm.grouped_matmul(x, w, sizes, impl)))

    ref = gmm.grouped_matmul(x, w, sizes, "xla")
    want = np.concatenate(
        [
            np.asarray(x[s:e]) @ np.asarray(w[g])
            for g, (s, e) in enumerate([(0, 10), (10, 10), (10, 27), (27, 30), (30, 50)])
        ]
    )
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        gmm.grouped_matmul(x, w, sizes, "megablox"), ref, rtol=1e-5, atol=1e-5
    )
    g_ref = jax.grad(lambda x, w: loss("xla", x, w), (0, 1))(x, w)
    g_mb = jax.grad(lambda x, w: loss("megablox", x, w), (0, 1))(x, w)
    for a, b in zip(g_mb, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert gmm.resolve("auto", "tpu") == "megablox" and gmm.resolve("auto", "cpu") == "xla"


@pytest.mark.slow
def test_expert_parallel_fsdp_tp_match_single_device():
    config = _config("tiny_moe", num_layers=2)
    params = models.init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 8), 0, config.vocab_size)

    def loss_fn(params, tokens):
        logits, route = models.forward(config, params, tokens, with_router=True)
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
        return nll + 0.01 * route["lb_loss"].mean(), logits

    step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
    one = jax.devices()[0]
    (ref_loss, ref_logits), ref_grads = step(*jax.device_put((params, tokens), one))
    mesh = sharding.make_mesh([("data", 2), ("fsdp", 2), ("tp", 2)])
    sharded = sharding.shard_params(config, params, mesh)
    assert sharded["moe"]["gate"][...].sharding.spec == P(None, "fsdp", None, "tp")
    with jax.set_mesh(mesh):
        rows = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
        (loss, logits), grads = step(sharded, rows)
    assert len(logits.sharding.device_set) == 8
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5), grads, ref_grads)


@pytest.mark.slow
def test_lora_on_attention_of_an_moe_model():
    config = _config()
    params = models.init_params(config, jax.random.key(0))
    spec = lora.LoraSpec(2, 4.0, ("q", "k", "v", "o"))
    adapters = lora.init_adapters(config, spec, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # B != 0: the adapters act
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, config.vocab_size)
    attached = models.forward(config, lora.attach(params, adapters, spec), tokens)
    merged = models.forward(config, lora.merge(params, adapters, spec), tokens)
    np.testing.assert_allclose(attached, merged, atol=1e-5)
    assert not np.allclose(attached, models.forward(config, params, tokens), atol=1e-3)
    with pytest.raises(ValueError, match="attention only"):
        lora.init_adapters(config, lora.LoraSpec(2, 4.0, ("q", "gate")), jax.random.key(1))


def test_bad_moe_configs_are_one_line_errors():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        _config(num_experts_per_tok=9)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        _config(mlp_only_layers=(7,))
    with pytest.raises(ValueError, match="moe_impl"):
        _config(moe_impl="triton")
    config = _config()
    params = models.init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="routing has shape"):
        models.forward(
            config, params, jnp.zeros((1, 3), jnp.int32), routing=jnp.zeros((2, 1, 3, 1))
        )


def _tie_router(params, first, second):
    """params whose routers score expert `first` exactly as expert `second` (a routing tie)."""
    out = jax.tree.map(lambda x: x, params)
    router = out["moe"]["router"]
    w = router[...]
    router.set_value(w.at[..., first].set(w[..., second]))
    return out


@functools.cache  # the replay tests share one sampled rollout
def _sampled_with_routing(spec, P=4, G=2):
    """(config, the trainer's params, prompts, lengths, generation, routing [P, G, ...], stats)
    from a router with an exact tie that the trainer's rounding-sized change breaks."""
    from ebpo_jax import sampler

    config = _config(num_experts=4)
    params = _tie_router(models.init_params(config, jax.random.key(0)), 1, 0)
    N = spec.max_new_tokens
    prompts = jax.random.randint(jax.random.key(1), (P, 5), 1, config.vocab_size)
    plen = jnp.array([5, 3, 4, 2])[:P]
    spec = spec._replace(num_samples=G, record_routing=True)
    gen = sampler.generate(config, params, prompts, plen, spec, rng=jax.random.key(2))
    recorded, stats = gen.routing, gen.stats
    assert recorded["comp"].shape == (P * G, 2, N, 2)
    assert recorded["prompt"].shape == (P * G, 2, 5, 2)
    # The trainer's router differs by a rounding-sized amount that breaks the tie the other
    # way, as a different batch, kernel or precision can.
    bumped = jax.tree.map(lambda x: x, params)
    bumped["moe"]["router"].set_value(bumped["moe"]["router"][...].at[..., 1].add(1e-7))
    routing = jax.tree.map(lambda x: x.reshape(P, G, *x.shape[1:]), recorded)
    return config, bumped, prompts, plen, gen, routing, stats


def _packed_logprobs(config, params, prompts, plen, gen, routing):
    """trainer/packing.py's log-probs [B, N] of the completions, 2 rows per micro-batch."""
    from ebpo_jax.trainer import packing

    (B, N), P = gen.tokens.shape, prompts.shape[0]
    lay = packing.Layout(P, B // P, N, prompts.shape[1] + N, 2, -(-B // 2), share_prompt=True)
    mask_BN = jnp.arange(N)[None] < gen.lengths[:, None]
    pl = packing.plan(lay, plen, packing.loss_span(mask_BN))
    assert int(pl.num_micro) > 1
    fwd = jax.jit(
        lambda r: packing.packed_completion_logprobs(config, params, r, slots=(B, N),
                                                     with_entropy=False)
    )  # fmt: skip
    micro = lambda u: packing.micro_batch(lay, pl, prompts, plen, gen.tokens, u, routing)
    return sum(fwd(micro(u)) for u in range(int(pl.num_micro)))


def _replay_gap(spec, P=4, G=2):
    """The sampled log-probs vs the trainer's recompute, without and with routing replay, by the
    padded and the packed forward: ({"padded": (without, with), "packed": ...}, stats)."""
    from ebpo_jax.trainer.batch import MicroBatch
    from ebpo_jax.trainer.update import completion_logprobs

    config, params, prompts, plen, gen, routing, stats = _sampled_with_routing(spec, P, G)
    mask = np.arange(spec.max_new_tokens)[None] < np.asarray(gen.lengths)[:, None]

    def padded(routing):
        mb = MicroBatch(prompts, plen, gen.tokens, gen.lengths, routing=routing)
        return completion_logprobs(config, params, mb, with_entropy=False)

    def packed(routing):
        return _packed_logprobs(config, params, prompts, plen, gen, routing)

    gap = lambda logp: np.abs(np.where(mask, np.asarray(logp) - np.asarray(gen.logprobs), 0)).max()
    gaps = {f.__name__: (gap(f(None)), gap(f(routing))) for f in (padded, packed)}
    return gaps, stats


def test_routing_replay_makes_recomputed_logprobs_equal_the_samplers():
    from ebpo_jax import sampler

    gaps, _ = _replay_gap(sampler.SamplerSpec(max_new_tokens=6))
    for without, with_replay in gaps.values():  # the padded and the packed forward
        assert without > 1e-3  # flipped experts: the recomputed log-probs move
        assert with_replay <= 1e-6


@pytest.mark.slow
def test_routing_replay_with_few_slots_and_a_short_page_pool():
    from ebpo_jax import sampler

    # 8 rows through 3 slots, 4-token pages, a pool of 6 pages (3 slots x 3 pages needed):
    # rows are refilled, and growing rows preempt the youngest, which recompute their tokens;
    # steps run on the live slots (1, 2 or 3 of 3), whose experts go back to their rows.
    spec = sampler.SamplerSpec(max_new_tokens=6, slots=3, page_size=4, kv_pages=6, live_buckets=3)
    gaps, stats = _replay_gap(spec)
    assert int(stats.preempted) > 0 and int(stats.computed) < int(stats.steps) * stats.slots
    for without, with_replay in gaps.values():
        assert without > 1e-3
        assert with_replay <= 1e-6


def test_record_routing_needs_a_mixture_of_experts_config():
    from ebpo_jax import sampler

    config = models.get_config("tiny", vocab_size=32, num_layers=1, hidden_size=32)
    params = models.init_params(config, jax.random.key(0))
    spec = sampler.SamplerSpec(max_new_tokens=2, record_routing=True)
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts"):
        sampler.generate(config, params, jnp.ones((1, 2), jnp.int32), jnp.array([2]), spec,
                         rng=jax.random.key(0))  # fmt: skip


@pytest.mark.slow  # default: packing_test's packed == padded (dense), the replayed log-probs above
def test_packed_update_with_routing_replay_equals_the_padded_one():
    """One update with replay: packed rows == padded micro-batches (loss and gradients)."""
    from ebpo_jax import sampler
    from ebpo_jax.config import default_config
    from ebpo_jax.rollout.single_turn import Rollout
    from ebpo_jax.spec import resolve
    from ebpo_jax.trainer import make_update_fn
    from ebpo_jax.trainer.state import init_train_state, make_optimizer

    P, G, N = 4, 2, 6
    config, params, prompts, plen, gen, routing, _ = _sampled_with_routing(
        sampler.SamplerSpec(max_new_tokens=N), P, G
    )
    per_group = lambda x: x.reshape(P, G, *x.shape[1:])
    ro = Rollout(
        prompt_tokens=prompts,
        prompt_lengths=plen,
        answer_tokens=jnp.zeros((P, 1), jnp.int32),
        answer_lengths=jnp.ones((P,), jnp.int32),
        index=jnp.arange(P),
        cluster_ids=jnp.zeros((P,), jnp.int32),
        tokens=per_group(gen.tokens),
        logprobs=per_group(gen.logprobs),
        lengths=per_group(gen.lengths),
        rewards=jnp.tile(jnp.array([[1.0, 0.0], [0.0, 1.0]]), (2, 1)),
        group_valid=jnp.ones((P,), bool),
        generated_tokens=gen.lengths.sum(),
        all_same_frac=jnp.float32(0),
        action_mask=jnp.ones((P, G, N), bool),
        routing=routing,
    )

    def update(budget):
        c = default_config()
        c.prompts_per_step, c.group_size, c.sampler.max_new_tokens = P, G, N
        c.model.preset = "tiny_moe"  # the checks ask the config's model: an MoE one
        c.model.moe.routing_replay = True
        c.loss.tokens_per_microbatch = budget
        spec = resolve(c)
        opt = make_optimizer(spec.optim)
        state = init_train_state(params, opt, seed=0)
        return jax.jit(make_update_fn(spec.update, config, opt, eos_id=1))(state, ro)[1]

    padded, packed = update(0), update(3 * (5 + N))  # 3 rows of 11 tokens per micro-batch
    for k in ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/clip_frac_low"):
        np.testing.assert_allclose(packed[k], padded[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert padded["actor/grad_norm"] > 0
