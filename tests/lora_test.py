"""LoRA / QLoRA: exact base at init, adapter path == merged, gradients on adapters only,
every estimator and loss, sharding, checkpoints, PEFT export, optimizer-state memory."""

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ebpo_jax import advantages, losses, models, sampler, sharding
from ebpo_jax import config as config_lib
from ebpo_jax.models import lora, lora_checkpoint
from ebpo_jax.runtime.checkpoint import Checkpointer
from ebpo_jax.trainer import policy as policy_lib
from ebpo_jax.trainer.batch import MicroBatch
from ebpo_jax.trainer.policy import Policy, init_lora_state
from ebpo_jax.trainer.shardings import state_shardings
from ebpo_jax.trainer.update import completion_logprobs

CFG = models.get_config("tiny_qwen3")  # qk-norm, tied embeddings, float32
ALL = lora.LoraSpec(4, 8.0, tuple(lora.TARGETS))
FORWARD = jax.jit(models.forward, static_argnums=0)


@functools.cache
def _params(config=CFG):
    return models.init_params(config, jax.random.key(0))


def _trained(adapters, seed=3, scale=0.05):
    """Adapters with B != 0, as after some training."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def _tokens(B=2, T=12, seed=2):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, CFG.vocab_size)


def test_zero_initialised_adapter_is_exactly_the_base():
    params, tok = _params(), _tokens()
    adapters = lora.init_adapters(CFG, ALL, jax.random.key(1))
    assert all(
        not np.any(ab["b"].get_value()) for g in adapters["layers"].values() for ab in g.values()
    )
    base = FORWARD(CFG, params, tok)
    np.testing.assert_array_equal(FORWARD(CFG, lora.attach(params, adapters, ALL), tok), base)
    np.testing.assert_array_equal(FORWARD(CFG, lora.merge(params, adapters, ALL), tok), base)


@pytest.mark.parametrize(
    "targets",
    [pytest.param(tuple(lora.TARGETS), marks=pytest.mark.slow), ("q", "v"), ("o", "down")],
)
def test_merged_forward_equals_adapter_forward(targets):
    spec = lora.LoraSpec(4, 16.0, targets)
    params, tok = _params(), _tokens()
    adapters = _trained(lora.init_adapters(CFG, spec, jax.random.key(1)))
    adapter = FORWARD(CFG, lora.attach(params, adapters, spec), tok)
    merged = FORWARD(CFG, lora.merge(params, adapters, spec), tok)
    base = FORWARD(CFG, params, tok)
    assert float(jnp.abs(adapter - base).max()) > 0.05  # the adapters do change the model
    np.testing.assert_allclose(adapter, merged, atol=1e-5, rtol=0)


def test_merge_is_w_plus_scaled_a_b_in_float64():
    spec = lora.LoraSpec(3, 6.0, ("o",))
    adapters = _trained(lora.init_adapters(CFG, spec, jax.random.key(1)))
    merged = lora.merge(_params(), adapters, spec)["layers"]["attn"]["o"].get_value()
    a = np.asarray(adapters["layers"]["attn"]["o"]["a"].get_value(), np.float64)  # [L, H, Dh, r]
    b = np.asarray(adapters["layers"]["attn"]["o"]["b"].get_value(), np.float64)  # [L, r, D]
    w = np.asarray(_params()["layers"]["attn"]["o"].get_value(), np.float64)
    want = w + 2.0 * np.einsum("lhkr,lrd->lhkd", a, b)
    np.testing.assert_allclose(merged, want, atol=1e-6)


def _rollout(P=2, G=2, Tp=5, N=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return {
        "prompt": jax.random.randint(ks[0], (P, Tp), 1, CFG.vocab_size),
        "plen": jnp.array([Tp, 3])[:P],
        "comp": jax.random.randint(ks[1], (P * G, N), 1, CFG.vocab_size),
        "clen": jnp.array([N, 2, 3, N])[: P * G],
        "old_logp": -jax.random.uniform(ks[2], (P * G, N), minval=1.0, maxval=4.0),
        "rewards": jnp.array([[1.0, 0.0], [0.0, 0.0]])[:P, :G],
    }


def _loss(adapters, base, spec, ro, adv_B, *, agg="token-mean", kl_coef=0.0):
    """The trainer's loss (completion_logprobs + policy_loss) on the adapter path."""
    policy = Policy(CFG, spec).forward_params(adapters, base)
    mb = MicroBatch(ro["prompt"], ro["plen"], ro["comp"], ro["clen"])
    logp = completion_logprobs(CFG, policy, mb, with_entropy=False)
    ref = None
    if kl_coef:  # the reference: the base with the adapters off
        ref = jax.lax.stop_gradient(completion_logprobs(CFG, base, mb, with_entropy=False))
    mask = jnp.arange(ro["comp"].shape[1])[None] < ro["clen"][:, None]
    terms = losses.TokenTerms(logp, ro["old_logp"], adv_B, mask, ref_logp_BT=ref)
    loss, _ = losses.policy_loss(terms, losses.LossOptions(agg=agg, kl_coef=kl_coef))
    return loss


# One compile per (spec, agg, kl) shared by the tests below: the estimators only change adv.
GRAD = jax.jit(jax.value_and_grad(_loss), static_argnums=2, static_argnames=("agg", "kl_coef"))


@pytest.mark.slow  # the loop test (default) checks that only the adapters move
def test_gradients_reach_only_the_adapters():
    spec, base, ro = ALL, _params(), _rollout()
    state = init_lora_state(base, optax.adam(1e-2), spec, CFG, seed=0)
    adv = jnp.array([1.0, -1.0, 0.5, -0.5])
    # Through attach, the base's gradient exists but is not what the state differentiates:
    both = jax.jit(jax.grad(lambda a, b: _loss(a, b, spec, ro, adv), argnums=(0, 1)))
    g_adapters, g_base = both(state.params, state.base)
    # PEFT's init (B = 0): the first gradient reaches B only; A's is exactly 0.
    for g in g_adapters["layers"].values():
        for ab in g.values():
            assert not np.any(ab["a"].get_value()) and np.any(ab["b"].get_value())
    assert optax.tree.norm(g_base) > 0  # so keeping the base out of the optimizer matters
    # One optimizer step on the state: adapters move, the base is bit-identical, and the
    # optimizer's moments are adapter-shaped only.
    _, grads = GRAD(state.params, state.base, spec, ro, adv)
    opt = optax.adam(1e-2)
    updates, _ = opt.update(grads, state.opt_state, state.params)
    new = optax.apply_updates(state.params, updates)
    assert optax.tree.norm(jax.tree.map(jnp.subtract, new, state.params)) > 0
    n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
    n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert n_opt == 2 * n_adapter  # Adam's mu and nu, nothing of the base
    assert Policy(CFG, spec).frozen(state) is state.base
    assert state.ref_params is None


@pytest.mark.parametrize("estimator", advantages.names())
def test_lora_with_every_estimator(estimator):
    spec, base, ro = ALL, _params(), _rollout()
    adapters = _trained(lora.init_adapters(CFG, spec, jax.random.key(1)), scale=0.02)
    adv_PG, _, _ = advantages.estimate(estimator, ro["rewards"], advantages.init_eb_state())
    loss, grads = GRAD(adapters, base, spec, ro, adv_PG.reshape(-1))
    norm = optax.tree.norm(grads)
    assert np.isfinite(loss) and np.isfinite(norm) and norm > 0


@pytest.mark.parametrize(
    "agg",
    [
        "token-mean",
        pytest.param("seq-mean-token-mean", marks=pytest.mark.slow),
        pytest.param("seq-mean-token-sum", marks=pytest.mark.slow),
    ],
)
def test_lora_with_every_loss_aggregation_and_kl(agg):
    spec, base, ro = ALL, _params(), _rollout()
    adapters = _trained(lora.init_adapters(CFG, spec, jax.random.key(1)), scale=0.02)
    adv = jnp.array([1.0, -1.0, 0.5, -0.5])
    loss, grads = GRAD(adapters, base, spec, ro, adv, agg=agg, kl_coef=0.1)
    norm = optax.tree.norm(grads)
    assert np.isfinite(loss) and np.isfinite(norm) and norm > 0


def test_adapters_shard_by_the_rules_table():
    mesh = sharding.make_mesh([("data", 1), ("fsdp", 4), ("tp", 2)])
    spec = ALL
    state = jax.eval_shape(
        lambda b: init_lora_state(b, optax.adamw(1e-3), spec, CFG, seed=0),
        models.abstract_params(CFG),
    )
    sh = state_shardings(CFG, optax.adamw(1e-3), state, mesh)
    P = jax.sharding.PartitionSpec
    assert sh.params["layers"]["attn"]["q"]["a"].get_value().spec == P(None, "fsdp", None)
    assert sh.params["layers"]["attn"]["q"]["b"].get_value().spec == P(None, None, "tp", None)
    assert sh.params["layers"]["mlp"]["down"]["a"].get_value().spec == P(None, "tp", None)
    assert sh.base["layers"]["mlp"]["down"].get_value().spec == P(None, "tp", "fsdp")
    # Sharded forward on the adapter path == unsharded.
    base, tok = _params(), _tokens(B=4)
    adapters = _trained(lora.init_adapters(CFG, spec, jax.random.key(1)))
    want = FORWARD(CFG, lora.attach(base, adapters, spec), tok)
    with jax.set_mesh(mesh):
        b_sh = jax.device_put(base, sh.base)
        a_sh = jax.device_put(adapters, sh.params)
        got = jax.jit(lambda a, b: models.forward(CFG, lora.attach(b, a, spec), tok))(a_sh, b_sh)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(
    "base_dtype,tol",
    [
        pytest.param("int8", 0.03, marks=pytest.mark.slow),
        pytest.param("nf4", 0.3, marks=pytest.mark.slow),
    ],
)
def test_qlora_base(base_dtype, tol):
    pytest.importorskip("qwix")
    spec = lora.LoraSpec(4, 8.0, ("q", "v", "down"), base_dtype)
    base, tok = _params(), _tokens()
    q = jax.jit(lambda b: lora.quantize_base(b, spec))(base)
    w = q["layers"]["attn"]["q"].get_value()
    assert w.qvalue.dtype == (jnp.int8 if base_dtype == "int8" else jnp.uint4)
    want = FORWARD(CFG, base, tok)
    got = FORWARD(CFG, q, tok)  # quantization error only
    rel = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert 0 < rel < tol, rel
    adapters = _trained(lora.init_adapters(CFG, spec, jax.random.key(1)))
    np.testing.assert_allclose(
        FORWARD(CFG, lora.attach(q, adapters, spec), tok),
        FORWARD(CFG, lora.merge(q, adapters, spec), tok),
        atol=1e-5,
    )
    grads = jax.grad(_loss)(adapters, q, spec, _rollout(), jnp.array([1.0, -1.0, 0.5, -0.5]))
    assert np.isfinite(optax.tree.norm(grads)) and optax.tree.norm(grads) > 0
    # The quantized base shards: qvalue like its weight, per-channel scales along.
    mesh = sharding.make_mesh([("fsdp", 4), ("tp", 2)])
    sh = sharding.param_shardings(CFG, q, mesh)
    with jax.set_mesh(mesh):
        q_sh = jax.device_put(q, sh)
        got_sh = jax.jit(lambda b: models.forward(CFG, b, tok))(q_sh)
    np.testing.assert_allclose(got_sh, got, atol=1e-5)


def test_checkpoint_round_trip_of_adapters_is_exact(tmp_path):
    config = config_lib.default_config()
    config.model.preset = "tiny_qwen3"
    config.model.lora.rank = 4
    spec = lora.spec_from_config(config.model.lora)
    opt = optax.adamw(1e-3)
    state = init_lora_state(_params(), opt, spec, CFG, seed=0)
    state = state._replace(params=_trained(state.params))
    tree = state.saved()
    assert "base" not in tree and "ref_params" not in tree
    ref = policy_lib.base_reference(config.model, "/ckpt/base")
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(7, tree, {"lora_base": ref})
    with Checkpointer(str(tmp_path)) as ckpt:
        restored, extra = ckpt.restore(target=jax.tree.map(jnp.zeros_like, tree))
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    policy_lib.check_base_reference(extra["lora_base"], ref)
    with pytest.raises(config_lib.ConfigError, match="source"):
        policy_lib.check_base_reference(
            extra["lora_base"], policy_lib.base_reference(config.model, "/ckpt/other")
        )
    config.model.lora.rank = 8
    rank8 = policy_lib.base_reference(config.model, "/ckpt/base")
    with pytest.raises(config_lib.ConfigError, match="rank"):
        policy_lib.check_base_reference(extra["lora_base"], rank8)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("rank", -1, "model.lora.rank"),
        ("alpha", 0.0, "model.lora.alpha"),
        ("targets", "q,x", "model.lora.targets"),
        ("targets", "q,q", "model.lora.targets"),
        ("base_dtype", "int4", "model.lora.base_dtype"),
    ],
)
def test_bad_lora_config_is_a_one_line_error(field, value, match):
    c = config_lib.default_config()
    c.model.lora[field] = value
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.validate(c)


def test_sampler_paths_agree():
    spec, base = ALL, _params()
    state = init_lora_state(base, optax.adam(1e-3), spec, CFG, seed=0)
    state = state._replace(params=_trained(state.params))
    prompts = _tokens(B=2, T=6)
    gens = [
        sampler.generate(
            CFG,
            params,
            prompts,
            jnp.array([6, 4]),
            sampler.SamplerSpec(max_new_tokens=5, num_samples=2),
            rng=jax.random.key(0),
        )
        for params in (
            Policy(CFG, spec).sampled(state),
            lora.attach(state.base, state.params, spec),
        )
    ]
    np.testing.assert_array_equal(gens[0].tokens, gens[1].tokens)
    np.testing.assert_allclose(gens[0].logprobs, gens[1].logprobs, atol=1e-4)


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=pytest.mark.slow) for k in ("llama", "qwen3")]
)
def test_peft_loads_the_adapter_export(kind, tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers

    from ebpo_jax.models.peft_export import to_peft

    config = models.get_config("tiny" if kind == "llama" else "tiny_qwen3", vocab_size=64)
    base = models.init_params(config, jax.random.key(0))
    spec = lora.LoraSpec(4, 12.0, ("q", "k", "o", "up", "down"))
    adapters = _trained(lora.init_adapters(config, spec, jax.random.key(1)))
    models.to_hf(config, base, str(tmp_path / "base"))
    to_peft(config, spec, adapters, str(tmp_path / "adapter"), base_model_name_or_path="base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "base"), dtype=torch.float32
    )
    model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    tok = np.asarray(jax.random.randint(jax.random.key(2), (2, 9), 0, 64))
    with torch.no_grad():
        got = model(torch.as_tensor(tok)).logits.numpy()
    want = np.asarray(FORWARD(config, lora.merge(base, adapters, spec), jnp.asarray(tok)))
    assert np.abs(want - FORWARD(config, base, jnp.asarray(tok))).max() > 0.05
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # to_hf of the merged weights is the same model in plain transformers.
    models.to_hf(config, lora.merge(base, adapters, spec), str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "merged"), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        np.testing.assert_allclose(
            merged(torch.as_tensor(tok)).logits.numpy(), want, atol=1e-4, rtol=0
        )


def _lora_run(tmp_path, name, steps):
    from configs import micro

    c = micro.get_config()
    c.unlock()
    c.workdir, c.total_steps, c.mesh.devices = str(tmp_path / name), steps, 1
    c.model.lora.rank, c.loss.kl_coef = 4, 0.01
    c.optimizer.learning_rate = 1e-2
    return c


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """One uninterrupted 4-step LoRA run (B is still 0 after the first steps' all-zero
    advantages): its folder, config and summary, read by the tests below."""
    from ebpo_jax.trainer import loop

    root = tmp_path_factory.mktemp("lora_run")
    c = _lora_run(root, "full", 4)
    return root / "full", c, loop.train(c, log=lambda *_: None)


def test_lora_run_trains_adapters_only_through_the_loop(lora_run, tmp_path):
    """model.lora.rank > 0 through train(): only adapters (and their Adam moments) are saved
    and move; the sampler and the eval run the merged weights."""
    from ebpo_jax.runtime.checkpoint import load_params
    from ebpo_jax.trainer import loop

    full, _, s = lora_run
    assert s["step"] == 4 and np.isfinite(s["pass@1_end"])
    adapters = load_params(str(full))
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(adapters)[0]}
    assert names and all("'a'" in n or "'b'" in n for n in names), sorted(names)[:4]
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(adapters))  # B moved
    with Checkpointer(str(full / "checkpoints")) as ckpt:
        ref = ckpt.saved_extra()["lora_base"]
    assert ref["rank"] == 4 and ref["source"].startswith(("init(", "/")), ref
    # Checkpoints carried to another workdir (no config.json to compare) with another adapter
    # spec, or without LoRA, are refused before restoring: nothing is set aside as corrupt.
    shutil.copytree(full / "checkpoints", tmp_path / "moved" / "checkpoints")
    other = _lora_run(tmp_path, "moved", 3)
    other.model.lora.rank = 8
    with pytest.raises(config_lib.ConfigError, match="rank: checkpoint 4 vs config 8"):
        loop.train(other, log=lambda *_: None)
    assert not os.path.exists(tmp_path / "moved" / "config.json")  # refused: nothing written
    other.model.lora.rank = 0
    with pytest.raises(config_lib.ConfigError, match="holds LoRA adapters"):
        loop.train(other, log=lambda *_: None)
    assert not os.path.exists(tmp_path / "moved" / "checkpoints.corrupt")


def test_lora_run_exports_merged_hf_and_peft(lora_run, tmp_path):
    """convert_hf.py --lora_run: the run's adapters merged into its HF base equal the policy
    the run holds, and the PEFT folder holds every adapter."""

    from ebpo_jax.spec import resolve
    from ebpo_jax.tasks.protocol import build_task

    full, c, _ = lora_run
    task = build_task(resolve(c, 1).task, log=lambda *_: None)
    models.to_hf(task.model_config, task.params, str(tmp_path / "base"))
    from conftest import load_experiment

    convert_hf = load_experiment("convert_hf")  # the one copy hf_test may have loaded
    run, merged_dir = str(full), str(tmp_path / "merged")
    convert_hf.export_lora(str(tmp_path / "base"), run, merged_dir, str(tmp_path / "adapter"))
    _, merged = models.from_hf(merged_dir, dtype="float32")
    _, base = models.from_hf(str(tmp_path / "base"), dtype="float32")
    spec, _ = lora_checkpoint.restore_adapters(run, task.model_config)
    assert spec.rank == 4 and spec.targets == tuple(c.model.lora.targets.split(","))
    want = lora_checkpoint.policy_of_run(run, base, task.model_config)
    moved = 0.0
    for x, y, b in zip(jax.tree.leaves(merged), jax.tree.leaves(want), jax.tree.leaves(base)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)
        moved = max(moved, float(np.abs(np.asarray(y) - np.asarray(b)).max()))
    assert moved > 0  # the adapters changed the weights
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(spec.targets) * task.model_config.num_layers


@pytest.mark.slow  # two short runs beside the shared one
def test_resumed_lora_run_equals_uninterrupted(lora_run, tmp_path):
    """The base is not checkpointed: a resume rebuilds it and continues exactly."""
    from ebpo_jax.runtime.checkpoint import load_params
    from ebpo_jax.trainer import loop

    loop.train(_lora_run(tmp_path, "resumed", 4), log=lambda *_: None, stop_after=2)
    loop.train(_lora_run(tmp_path, "resumed", 4), log=lambda *_: None)
    a, b = (load_params(str(p)) for p in (lora_run[0], tmp_path / "resumed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)
