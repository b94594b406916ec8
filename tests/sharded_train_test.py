"""The full train step (sampling included) on a data x fsdp x tp mesh of 8 fake CPU devices
equals the single-device step; so does train() with a resume in the middle."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import micro
from ebpo_jax import models, sharding, tasks
from ebpo_jax.runtime.checkpoint import load_params
from ebpo_jax.sharding import batch_sharded
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.families import arithmetic as task_arithmetic
from ebpo_jax.tasks.protocol import model_config_from
from ebpo_jax.trainer import loop
from ebpo_jax.trainer.shardings import state_shardings as train_state_shardings
from ebpo_jax.trainer.state import init_train_state, make_optimizer
from ebpo_jax.trainer.step import make_train_step

EOS = tasks.EOS_ID


def _config():
    c = micro.get_config()
    c.unlock()
    c.prompts_per_step, c.group_size = 8, 4
    c.optimizer.learning_rate = 3e-3
    c.loss.kl_coef = 0.01  # the reference policy is sharded too
    c.loss.num_microbatches = 2
    c.model.overrides.num_heads = 4
    c.model.overrides.num_kv_heads = 2  # kv heads split over tp=2
    c.mesh.shape, c.mesh.axes = (2, 2, 2), ("data", "fsdp", "tp")
    return c


def _reward(*a):
    return tasks.reward_fn(*a, eos_id=EOS)


@pytest.mark.slow  # ~1 min on an idle 2-core CPU (two compiles of the full step)
def test_fsdp_tp_data_train_step_equals_single_device():
    c = _config()
    spec = resolve(c)
    tok, train, _ = task_arithmetic.load_problems(spec.task)
    mc = model_config_from(spec.task.model, tok.vocab_size)
    if mc.vocab_size % 2:  # the vocabulary is split over tp
        mc = mc.replace(vocab_size=mc.vocab_size + 1)
    opt = make_optimizer(spec.optim)
    params = models.init_params(mc, jax.random.key(0))
    state = init_train_state(params, opt, seed=0, with_ref=True)
    batch = jax.tree.map(jnp.asarray, tasks.PromptSource(train, tok, 8, seed=3).next_batch())
    one = jax.devices()[0]
    ref, m_ref = jax.jit(make_train_step(spec, mc, opt, _reward, EOS))(
        jax.device_put(state, one), jax.device_put(batch, one)
    )

    mesh = sharding.make_mesh(c.mesh, jax.devices()[:8])
    state_sh = train_state_shardings(mc, opt, state, mesh)
    batch_sh = batch_sharded(batch, mesh, c.prompts_per_step)
    step = jax.jit(
        make_train_step(spec, mc, opt, _reward, EOS, mesh=mesh),
        in_shardings=(state_sh, batch_sh),
        out_shardings=(state_sh, None),
    )
    with jax.set_mesh(mesh):
        out, m = step(jax.device_put(state, state_sh), jax.device_put(batch, batch_sh))
    # Weights really are split over fsdp and tp, not replicated.
    w = out.params["layers"]["mlp"]["gate"][...]
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
    assert w.addressable_shards[0].data.shape == (w.shape[0], w.shape[1] // 2, w.shape[2] // 2)
    assert float(m_ref["reward/pass_rate"]) == float(m["reward/pass_rate"])
    for name, v in m_ref.items():
        np.testing.assert_allclose(m[name], v, rtol=1e-4, atol=1e-5, err_msg=name)
    # Loss, KL, gradient norm and rewards above match to 1e-4; the weights after one Adam step
    # carry the rounding of near-zero gradients (Adam divides by sqrt(v)), hence the atol.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5), out.params, ref.params
    )


def _loop_config(workdir, shape, devices):
    c = micro.get_config()
    c.unlock()
    c.workdir = str(workdir)
    c.model.overrides.num_heads = 4
    c.model.overrides.num_kv_heads = 2  # kv heads split over tp=2
    c.model.overrides.vocab_size = 32  # the char vocabulary (22) padded to split over tp
    c.mesh.shape, c.mesh.axes = shape, ("data", "fsdp", "tp")[: len(shape)]
    c.mesh.devices = devices  # 1: a one-device mesh although the test sees 8 devices
    return c


def _metric_rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    timing = ("_time_s", "tokens_per_s")
    return [
        {k: v for k, v in r.items() if not k.endswith(timing) and not k.startswith("phase/")}
        for r in rows
    ]


@pytest.mark.slow  # ~2.5 min on an idle 2-core CPU: three short runs, each compiling its programs
def test_train_loop_on_2x2x2_mesh_with_resume_and_sampler_mesh_equals_one_device(tmp_path):
    quiet = lambda *_: None
    loop.train(_loop_config(tmp_path / "one", (1,), 1), log=quiet)
    sharded = _loop_config(tmp_path / "eight", (2, 2, 2), 0)
    first = loop.train(sharded, log=quiet, stop_after=3)
    assert first["stopped_early"] and first["step"] == 3
    # The resume restores params, Adam moments and EB state into the 2x2x2 shardings, and
    # samples on its own data=4 x tp=2 mesh (weights resharded device to device).
    sharded.sampler.mesh = "data=4,tp=2"
    assert loop.train(sharded, log=quiet)["resumed_from"] == 3
    one, eight = _metric_rows(tmp_path / "one"), _metric_rows(tmp_path / "eight")
    assert [r["step"] for r in eight] == [0, 1, 2, 3, 4]
    for a, b in zip(one, eight, strict=True):
        assert a.keys() == b.keys()
        for name, v in a.items():
            if name.startswith(("reward/", "adv/all_same", "perf/", "response_length/")):
                assert b[name] == v, (a["step"], name)  # same tokens, same rewards
            else:
                np.testing.assert_allclose(b[name], v, rtol=1e-5, atol=1e-7, err_msg=name)
    a, b = (load_params(str(tmp_path / n)) for n in ("one", "eight"))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-4, atol=5e-5), a, b)
