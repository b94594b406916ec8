"""Ahead-of-time compilation of the real programs for a TPU topology, on a CPU host.

The programs are the trainer's own update (`make_update_fn`) and the sampler's own jitted
prefill/decode, lowered with abstract inputs (`jax.ShapeDtypeStruct` + sharding): no weights
are ever allocated. The report (memory per device, analytic FLOPs) is in aot_report.
"""

import dataclasses
import math
import time

import jax
import numpy as np

from ebpo_jax.aot_report import (
    ProgramReport,
    is_resource_exhausted,
    mesh_str,
    report_from_compiled,
    sampler_flops,
    step_time_estimate,
    topology_devices,
    total_params,
    update_flops,
)
from ebpo_jax.sharding import batch_sharded, parse_mesh
from ebpo_jax.trainer.state import state_shardings as train_state_shardings


def abstract(tree, shardings):
    """ShapeDtypeStruct leaves carrying `shardings` (a matching pytree or one sharding)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def model_config_of(config):
    """The policy ModelConfig the trainer would build (the preset's own vocabulary by default)."""
    from types import SimpleNamespace

    from ebpo_jax import models
    from ebpo_jax.trainer.loop import model_config_from

    vocab = models.PRESETS[config.model.preset]["vocab_size"]
    return model_config_from(config, SimpleNamespace(vocab_size=vocab))


def abstract_inputs(config, mc, prompt_len: int):
    """(abstract TrainState, abstract Rollout, optimizer) at the config's shapes: no allocation."""
    from ebpo_jax import models, tasks
    from ebpo_jax.trainer.rollout import batch_rounds, make_rollout_fn
    from ebpo_jax.trainer.state import init_train_state, make_optimizer

    optimizer = make_optimizer(config)
    params = models.abstract_params(mc)
    state = jax.eval_shape(
        lambda p: init_train_state(
            p, optimizer, seed=config.seed, with_ref=config.loss.kl_coef > 0
        ),
        params,
    )
    n = batch_rounds(config) * config.prompts_per_step
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
    answer_len = 64  # answers are short; their width does not move the memory
    batch = tasks.PromptBatch(
        i32(n, prompt_len), i32(n), i32(n, answer_len), i32(n), i32(n), i32(n), i32(n)
    )
    # The rollout's own output structure (host reward: rewards are filled in between jits).
    rollout = make_rollout_fn(config, mc, None, eos_id=1)
    ro = jax.eval_shape(rollout, params, batch, jax.random.key(0))
    return state, ro, optimizer


def compile_update(config, mc, mesh, prompt_len: int):
    """The trainer's own update step (make_update_fn), sharded by the rules and compiled."""
    from ebpo_jax.trainer.step import make_update_fn

    state, ro, optimizer = abstract_inputs(config, mc, prompt_len)
    state_sh = train_state_shardings(mc, optimizer, state, mesh)
    ro_sh = batch_sharded(ro, mesh, config.prompts_per_step, mc.sharding_rules)
    update = make_update_fn(config, mc, optimizer, eos_id=1)
    jitted = jax.jit(
        update, in_shardings=(state_sh, ro_sh), out_shardings=(state_sh, None), donate_argnums=0
    )
    with jax.set_mesh(mesh):
        return jitted.lower(state, ro).compile(), state.params, state_sh.params


def compile_slot_sampler(config, mc, mesh, params, prompts: int, prompt_len: int):
    """The continuous-batching sampler's prefill and slot decode (sampler.slots > 0)."""
    from ebpo_jax import sampler, slots

    G, N, s = config.group_size, config.sampler.max_new_tokens, config.sampler
    sampling = sampler._Sampling(float(s.temperature), int(s.top_k), float(s.top_p))
    shards = sampler._data_size(mesh, None)
    sampler._check_slots(s.slots, prompts, prompts * G, shards, None)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    prompt_sh = sampler._batch_sharding(mesh, None, prompts, True)
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    prompt_PT = jax.ShapeDtypeStruct((prompts, prompt_len), np.int32, sharding=prompt_sh)
    lengths_P = jax.ShapeDtypeStruct((prompts,), np.int32, sharding=prompt_sh)
    static = {"config": mc, "sampling": sampling, "num_samples": G}
    with jax.set_mesh(mesh):
        prefill = slots.prefill_jit.lower(
            params, prompt_PT, lengths_P, rng, prompt_sharding=prompt_sh, **static
        )
        out = prefill.out_info
        prefill = prefill.compile()
        outs = [
            jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh)
            for o, sh in zip(jax.tree.leaves(out), jax.tree.leaves(prefill.output_shardings))
        ]
        cache, first_R, first_logp_R = jax.tree.unflatten(jax.tree.structure(out), outs)
        eos = jax.ShapeDtypeStruct((1,), np.int32, sharding=rep)
        decode = slots.decode_jit.lower(
            params, cache, first_R, first_logp_R, lengths_P, rng, eos,
            slots=s.slots, shards=shards, max_new_tokens=N,
            slot_sharding=sampler._batch_sharding(mesh, None, s.slots, True), **static,
        ).compile()  # fmt: skip
    return prefill, decode


def compile_sampler(config, mc, mesh, params, prompts: int, prompt_len: int):
    """The sampler's own jitted prefill and decode for `prompts` prompts x G samples."""
    from ebpo_jax import sampler

    G, N = config.group_size, config.sampler.max_new_tokens
    s = config.sampler
    if 0 < s.get("slots", 0) < prompts * G:
        return compile_slot_sampler(config, mc, mesh, params, prompts, prompt_len)
    sampling = sampler._Sampling(float(s.temperature), int(s.top_k), float(s.top_p))
    row_sh = sampler._batch_sharding(mesh, None, prompts * G, True)
    prompt_sh = sampler._batch_sharding(mesh, None, prompts, False)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    tok_sh = prompt_sh or rep
    prompt_PT = jax.ShapeDtypeStruct((prompts, prompt_len), np.int32, sharding=tok_sh)
    lengths_P = jax.ShapeDtypeStruct((prompts,), np.int32, sharding=tok_sh)
    static = {"config": mc, "sampling": sampling}
    with jax.set_mesh(mesh):
        prefill = sampler._prefill_jit.lower(
            params,
            prompt_PT,
            lengths_P,
            rng,
            num_samples=G,
            cache_size=prompt_len + N,
            prompt_sharding=prompt_sh,
            row_sharding=row_sh,
            **static,
        )
        out = prefill.out_info
        prefill = prefill.compile()
        carried = [
            jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh)
            for o, sh in zip(jax.tree.leaves(out), jax.tree.leaves(prefill.output_shardings))
        ]
        cache = jax.tree.unflatten(
            jax.tree.structure(out[0]), carried[: len(jax.tree.leaves(out[0]))]
        )
        rest = carried[len(jax.tree.leaves(out[0])) :]
        eos = jax.ShapeDtypeStruct((1,), np.int32, sharding=rep)
        decode = sampler._decode_jit.lower(
            params,
            cache,
            *rest,
            rng,
            eos,
            prompt_len=prompt_len,
            max_new_tokens=N,
            batch_sharding=row_sh,
            **static,
        ).compile()
    return prefill, decode


def compile_reshard(params, src_shardings, dst_shardings, mesh, dtype):
    """Weights from the trainer's mesh to the sampler's, device to device, in the compute dtype.

    The cast halves what every decoded token reads when the master weights are float32.
    """
    cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
    with jax.set_mesh(mesh):
        jitted = jax.jit(cast, out_shardings=dst_shardings)
        return jitted.lower(abstract(params, src_shardings)).compile()


def run(
    config, topology: str, *, prompt_len: int, sampler_prompts=None, sampler_mesh="", log=print
):
    """Compile update, weight reshard (with `sampler_mesh`) and sampler prefill/decode.

    Returns (reports, meta). A program the compiler cannot fit (RESOURCE_EXHAUSTED) gets a
    report with `error` set and fits=False; other compile errors propagate.
    """
    from ebpo_jax import config as config_lib
    from ebpo_jax import sharding

    spec, chip_name, devices = topology_devices(topology)
    config_lib.validate(config, len(devices))
    chips = math.prod(int(x) for x in chip_name.split(":")[1].split("x"))
    per_chip = max(1, len(devices) // chips)  # v4 topologies list each TensorCore
    hbm, peak = spec.hbm_bytes // per_chip, spec.peak_flops / per_chip
    mc = model_config_of(config)
    mesh = sharding.make_mesh(config.mesh, devices)
    s_mesh = sharding.make_mesh(parse_mesh(sampler_mesh), devices) if sampler_mesh else mesh
    prompts = sampler_prompts or config.prompts_per_step
    G, N = config.group_size, config.sampler.max_new_tokens
    reports = []

    def attempt(name, on_mesh, flops, note, compile_fn):
        t0 = time.perf_counter()
        try:
            compiled = compile_fn()
        except Exception as e:  # only the out-of-memory error is a result
            if not is_resource_exhausted(e):
                raise
            reports.append(
                ProgramReport(
                    name, mesh_str(on_mesh), 0, 0, 0, 0, 0, hbm, 0.0, peak, note, str(e)[:500]
                )
            )
            log(f"{name}: does not fit (RESOURCE_EXHAUSTED), {time.perf_counter() - t0:.0f} s")
            return None
        reports.append(report_from_compiled(name, compiled, on_mesh, hbm, flops, peak, note))
        log(f"{name}: compiled in {time.perf_counter() - t0:.0f} s")
        return compiled

    state, _, optimizer = abstract_inputs(config, mc, prompt_len)
    train_sh = train_state_shardings(mc, optimizer, state, mesh).params
    epochs = f"{config.loss.ppo_epochs} epoch(s) x {config.loss.num_minibatches} mini-batches"
    attempt(
        "train update",
        mesh,
        update_flops(config, mc, prompt_len),
        epochs,
        lambda: compile_update(config, mc, mesh, prompt_len)[0],
    )
    params = state.params
    samp_sh = sharding.param_shardings(mc, params, s_mesh)
    if s_mesh is not mesh:
        attempt(
            "reshard weights",
            s_mesh,
            0,
            f"to {mc.dtype}",
            lambda: compile_reshard(params, train_sh, samp_sh, s_mesh, mc.dtype),
        )
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, mc.dtype), params)
    sflops = sampler_flops(mc, prompts, G, prompt_len, N)
    calls = math.ceil(config.prompts_per_step / prompts)
    note = f"{prompts} prompts x {G} per call, {calls} call(s) per step"
    compiled = {}

    def sampler_programs():
        compiled["prefill"], compiled["decode"] = compile_sampler(
            config, mc, s_mesh, abstract(params, samp_sh), prompts, prompt_len
        )
        return compiled["prefill"]

    if attempt("sampler prefill", s_mesh, sflops["prefill"], note, sampler_programs) is not None:
        attempt("sampler decode", s_mesh, sflops["decode"], note, lambda: compiled["decode"])
        # Decoding is bound by HBM bandwidth: every step reads the weights and the whole cache.
        r = reports[-1]
        r.note += f"; >= {(N - 1) * r.argument_bytes * per_chip / spec.hbm_bandwidth:.0f} s at HBM bandwidth"
    from ebpo_jax.sampler import _data_size

    shards, tp = _data_size(s_mesh, None), dict(s_mesh.shape).get("tp", 1)
    estimate = step_time_estimate(config, mc, spec, prompt_len=prompt_len, shards=shards, tp=tp)
    meta = {
        "step_estimate": estimate,
        "topology": topology,
        "chip_topology": chip_name,
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "model": dataclasses.asdict(mc),
        "params": total_params(mc),
        "prompt_len": prompt_len,
        "max_new_tokens": N,
        "sequences_per_step": config.prompts_per_step * G,
        "train_mesh": dict(mesh.shape),
        "sampler_mesh": dict(s_mesh.shape),
        "flops_note": "analytic model FLOPs (6NT + causal attention); cost_analysis() counts a "
        "scanned layer once; remat recompute not included",
    }
    return reports, meta
