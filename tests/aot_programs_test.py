"""AOT lowers the programs a run executes: for configs/micro.py, the sampler's prefill and
decode (inside the run's jitted rollout), the sampler's weights and the update, traced by the
loop's own pieces on its own task and by pods/aot.py from the spec alone, are the same."""

import re

import jax
import jax.extend
import numpy as np
import pytest

from configs import micro
from ebpo_jax import models, sampler, sharding
from ebpo_jax.pods import aot
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.protocol import build_task
from ebpo_jax.trainer import loop
from ebpo_jax.trainer.runners import make_runner
from ebpo_jax.trainer.step import first


def _normal(jaxpr) -> str:
    """A jaxpr's text up to the numbering of shared sub-jaxprs (`_where3`), which depends on
    what was traced before."""
    return re.sub(r"\b(_[A-Za-z_]+?)\d+\b", r"\1", str(jaxpr))


def _nested(jaxpr, names: set) -> dict:
    """name -> the jaxpr of each nested jit called `name` inside `jaxpr` (any depth)."""
    found = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit") and eqn.params["name"] in names:
            found.setdefault(eqn.params["name"], eqn.params["jaxpr"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = _nested(sub, names) | found
    return found


def _run_programs(spec, mesh):
    """The run's programs as the loop builds them: name -> jaxpr text; the data's shapes; the
    sampler's weights' dtypes."""
    task = build_task(spec.task, mesh=mesh, log=lambda *_: None)
    view = loop.policy_lib.of(spec, task.model_config)
    state, sh, optimizer = loop._init_state(spec, view, task, mesh)
    pieces = make_runner(spec, task, optimizer, sh, view).pieces
    batch = first(sh.place_batches(task.source.next_batches(1)))
    weights = pieces.sampler_weights(pieces.policy(state))
    key = jax.random.key(0)
    with jax.set_mesh(sh.sampler_mesh):
        rollout = pieces.rollout.trace(weights, batch, key)
    ran = {k: _normal(v) for k, v in _nested(rollout.jaxpr.jaxpr, {"prefill", "decode"}).items()}
    ro = sharding.abstract(rollout.out_info, sh.rollout)  # placed as pieces.to_trainer places it
    with jax.set_mesh(mesh):
        ran["update"] = _normal(pieces.update.trace(state, ro).jaxpr)
        ran["update text"] = pieces.update.lower(state, ro).as_text()
        if pieces.weights.is_lora:
            ran["lora merge"] = _normal(pieces.policy.trace(state).jaxpr)
    task.close()
    data = {"answer_len": batch.answer_tokens.shape[1], "stop_ids": task.stop_ids}
    shapes = batch.prompt_tokens.shape[1], task.model_config.vocab_size, data
    return ran, shapes, jax.tree.map(lambda x: x.dtype, weights)


def _aot_programs(spec, mesh, shapes):
    """The programs pods/aot.py lowers for the spec on the same devices: name -> jaxpr text.
    `shapes`: what only the data says: prompt width, vocabulary, answer width and stop ids."""
    prompt_len, vocab_size, data = shapes
    mc = aot.model_config_of(spec, vocab_size)
    step, state, ro = aot.make_step(spec, mc, mesh, prompt_len, **data)
    with jax.set_mesh(mesh):
        out = {
            "update": _normal(step.update.trace(state, ro).jaxpr),
            "update text": step.update.lower(state, ro).as_text(),
        }
    weights = {}
    params = step.pieces.weights.programs(
        state, lambda name, _on, _note, traced: weights.update({name: traced})
    )
    out |= {name: _normal(traced.jaxpr) for name, traced in weights.items()}
    s_spec, rows, turns = aot.sampler_call(spec.rollout, spec.rollout.prompts_per_call)
    session = sampler.Session(mc, s_spec, mesh=step.sh.sampler_mesh, turns=turns)
    programs = session.compile(params, rows, prompt_len, lower_only=True)
    out |= {name: _normal(programs[name][0].jaxpr) for name in ("prefill", "decode")}
    return out, jax.tree.map(lambda x: x.dtype, params)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="micro"),
        pytest.param({"model.lora.rank": 4}, marks=pytest.mark.slow, id="lora"),
        pytest.param({"sampler.param_dtype": "int8"}, id="int8"),
    ],
)
def test_aot_lowers_the_programs_a_micro_run_executes(overrides):
    c = micro.get_config()
    c.unlock()
    c.mesh.devices = 1  # micro's mesh, on one of the 8 test devices
    c.update_from_flattened_dict(overrides)
    spec = resolve(c, jax.device_count())
    mesh = loop.make_mesh(spec.mesh)
    ran, shapes, ran_dtypes = _run_programs(spec, mesh)
    compiled, aot_dtypes = _aot_programs(spec, mesh, shapes)
    assert ran_dtypes == aot_dtypes  # the sampler runs the weights AOT compiles it for
    lora = {"lora merge"} if "model.lora.rank" in overrides else set()
    assert set(ran) == {"prefill", "decode", "update", "update text"} | lora
    for name in ran:
        assert compiled[name] == ran[name], name
    assert "while" in ran["decode"] and np.all(["dot_general" in ran[n] for n in ran])


def _lora_sampler_weights(overrides):
    """(the step, its mesh, the weight programs' names, the sampler's abstract params) of
    micro with LoRA rank 4 and `overrides`."""
    c = micro.get_config()
    c.unlock()
    c.update_from_flattened_dict({"model.lora.rank": 4} | overrides)
    spec = resolve(c, jax.device_count())
    mesh = loop.make_mesh(spec.mesh)
    step, state, _ = aot.make_step(spec, aot.model_config_of(spec), mesh, 8)
    names = []
    params = step.pieces.weights.programs(state, lambda name, *_: names.append(name))
    assert jax.tree.structure(params) == jax.tree.structure(step.sh.sampler_params)
    return step, mesh, names, params


def test_lora_merged_weights_are_cast_for_the_sampler():
    """LoRA with sampler.param_dtype: the merge, then the cast of the merged model's weights
    (laid out as the model's, not as the adapters') on the trainer's mesh."""
    _, _, names, params = _lora_sampler_weights(
        {"mesh.devices": 1, "sampler.param_dtype": "bfloat16"}
    )
    assert names == ["lora merge", "cast weights"]
    assert {str(x.dtype) for x in jax.tree.leaves(params)} == {"bfloat16"}


def test_int8_sampler_weights_quantize_the_merged_lora_model_sharded_like_its_weights():
    """LoRA with sampler.param_dtype=int8 on an fsdp x tp mesh: the merge, then the quantize;
    each int8 array laid out as its weight, its scale too except along the reduced inputs."""
    step, mesh, names, params = _lora_sampler_weights(
        {"mesh.devices": 4, "mesh.shape": (2, 2), "mesh.axes": ("fsdp", "tp")}
        | {"sampler.param_dtype": "int8", "model.overrides.num_kv_heads": 2}
    )
    assert names == ["lora merge", "cast weights"]
    q = params["layers"]["attn"]["q"].get_value()  # [L, D, H, Dh], D reduced
    assert q.qvalue.dtype == np.int8 and q.scale.shape == (*q.shape[:1], 1, *q.shape[2:])
    weights = sharding.param_shardings(
        None, models.abstract_params(step.pieces.view.model_config), mesh
    )
    want = weights["layers"]["attn"]["q"].get_value().spec
    assert q.qvalue.sharding.spec == want and any(want)  # sharded, as the weight is
    assert q.scale.sharding.spec[1] is None and tuple(q.scale.sharding.spec)[2:] == tuple(want)[2:]
