"""Ahead-of-time compilation of the real programs for a TPU topology, on a CPU host.

The programs are the trainer's own update (`make_update_fn`) and the sampler's own jitted
prefill/decode, lowered with abstract inputs (`jax.ShapeDtypeStruct` + sharding): no weights
are ever allocated. The report (memory per device, analytic FLOPs) is in aot_report.
"""

import dataclasses
import functools
import math
import time

import jax
import numpy as np

from ebpo_jax import models
from ebpo_jax.pods.aot_report import (
    DAPO_GENERATED_PER_KEPT,
    ProgramReport,
    is_resource_exhausted,
    mesh_str,
    report_from_compiled,
    sampler_flops,
    step_time_estimate,
    topology_devices,
    total_params,
    update_flops,
    with_refill,
)
from ebpo_jax.pods.hardware import GiB
from ebpo_jax.rollout.single_turn import make_rollout_fn, sampler_spec_of
from ebpo_jax.sampler import engine
from ebpo_jax.sharding import make_mesh
from ebpo_jax.spec import RunSpec, resolve
from ebpo_jax.tasks import episodes
from ebpo_jax.tasks.protocol import Reward, Task, model_config_from
from ebpo_jax.trainer.runners import make_runner
from ebpo_jax.trainer.shardings import make_sampler_mesh, make_shardings
from ebpo_jax.trainer.state import make_optimizer


def abstract(tree, shardings):
    """ShapeDtypeStruct leaves carrying `shardings` (a matching pytree or one sharding)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def model_config_of(spec: RunSpec):
    """The policy ModelConfig the trainer would build (the preset's own vocabulary by default)."""
    from ebpo_jax import models

    vocab = models.PRESETS[spec.task.model.preset]["vocab_size"]
    return model_config_from(spec.task.model, vocab)


def shape_task(spec: RunSpec, mc, params) -> Task:
    """A Task with the shapes and reward kind of a math run, and no data: what the loop's
    step builder needs to make the programs the loop runs."""
    from ebpo_jax.tasks.families import math_data as task_math

    return Task(
        tokenizer=None,
        model_config=mc,
        params=params,
        source=None,
        reward=Reward(None, jittable=False),  # host reward: rewards are filled in between jits
        cluster_ids=functools.partial(task_math.cluster_ids, spec.task.run.eb_clusters),
        num_clusters=1,
        stop_ids=(1,),
        evaluate=None,
    )


def abstract_inputs(spec: RunSpec, mc, prompt_len: int):
    """(abstract TrainState, abstract Rollout, optimizer) at the spec's shapes: no allocation."""
    from ebpo_jax import models, tasks
    from ebpo_jax.trainer import policy

    optimizer = make_optimizer(spec.optim)
    params = models.abstract_params(mc)
    init = lambda p: policy.of(spec, mc).init(p, optimizer, seed=spec.run.seed)
    state = jax.eval_shape(init, params)
    n = spec.rollout.batch_prompts
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
    answer_len = 64  # answers are short; their width does not move the memory
    batch = tasks.PromptBatch(
        i32(n, prompt_len), i32(n), i32(n, answer_len), i32(n), i32(n), i32(n), i32(n)
    )
    task = shape_task(spec, mc, params)
    rollout = make_rollout_fn(spec.rollout, mc, None, task.stop_ids, task.cluster_ids)
    ro = jax.eval_shape(rollout, params, batch, jax.random.key(0))
    return state, ro, optimizer


def make_step(spec: RunSpec, mc, mesh, prompt_len: int, devices=None):
    """The loop's own runner (jitted rollout and update with the run's shardings), abstractly.

    `devices`: every device of the topology (a split run's sampler takes those after the mesh).
    """
    state, ro, optimizer = abstract_inputs(spec, mc, prompt_len)
    sh = make_shardings(spec, mc, optimizer, state, mesh, devices)
    step = make_runner(spec, shape_task(spec, mc, state.params), optimizer, sh)
    # Inputs carry the loop's shardings, as its placed arrays do: the same program is traced.
    return step, abstract(state, sh.state), abstract(ro, sh.rollout)


def compile_update(spec: RunSpec, mc, mesh, prompt_len: int, devices=None):
    """The trainer's own jitted update (the loop's runner.update), lowered and compiled."""
    step, state, ro = make_step(spec, mc, mesh, prompt_len, devices)
    with jax.set_mesh(mesh):
        return step.update.lower(state, ro).compile(), state.params, step.sh.state.params


def _sampler_inputs(spec, mc, mesh, prompts: int, prompt_len: int):
    """The plan and abstract (rng, prompts, lengths, stop ids) of one sampler call on mesh."""
    plan = engine.make_plan(spec, prompts, prompt_len, mesh, None, mc.sharding_rules)
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    prompt_sh = plan.prompt_lead or rep
    key = jax.eval_shape(lambda: jax.random.key(0))
    rng = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    prompt_PT = jax.ShapeDtypeStruct((prompts, prompt_len), np.int32, sharding=prompt_sh)
    lengths_P = jax.ShapeDtypeStruct((prompts,), np.int32, sharding=prompt_sh)
    eos = jax.ShapeDtypeStruct((len(spec.eos_ids),), np.int32, sharding=rep)
    return plan, (rng, prompt_PT, lengths_P, eos)


def _outputs(lowered, compiled):
    """A compiled program's outputs as abstract arrays with their shardings."""
    out = lowered.out_info
    leaves = [
        jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sh)
        for o, sh in zip(jax.tree.leaves(out), jax.tree.leaves(compiled.output_shardings))
    ]
    return jax.tree.unflatten(jax.tree.structure(out), leaves)


def _compile_prefill(params, prompt_PT, lengths_P, rng, static):
    """The engine's prefill compiled, and its outputs as the abstract `Prefilled` decode takes."""
    lowered = engine.prefill_jit.lower(params, prompt_PT, lengths_P, rng, **static)
    prefill = lowered.compile()
    return prefill, engine.Prefilled(*_outputs(lowered, prefill))


def compile_sampler(spec, mc, mesh, params, prompts: int, prompt_len: int):
    """The engine's jitted prefill and decode (sampler.SamplerSpec `spec`) on `mesh`.

    Returns (prefill, decode, plan): the Plan says the pool's pages per shard and the slots.
    """
    plan, (rng, prompt_PT, lengths_P, eos) = _sampler_inputs(spec, mc, mesh, prompts, prompt_len)
    static = {"config": mc, "spec": spec, "plan": plan}
    with jax.set_mesh(mesh):
        prefill, prefilled = _compile_prefill(params, prompt_PT, lengths_P, rng, static)
        decode = engine.decode_jit.lower(params, prefilled, lengths_P, rng, eos, **static)
        decode = decode.compile()
    return prefill, decode, plan


def compile_turns(spec, mc, mesh, params, rows: int, prompt_len: int):
    """The multi-turn sampler (sampler.TurnSession, one row per prompt) on `mesh`: its
    prefill, first turn and continued turn, compiled. Returns (prefill, begin, resume, plan)."""
    plan, (rng, prompt_PT, lengths_P, eos) = _sampler_inputs(spec, mc, mesh, rows, prompt_len)
    engine.check_turns(spec, plan)
    static = {"config": mc, "spec": spec, "plan": plan}
    per_row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=lengths_P.sharding)
    N = spec.max_new_tokens
    with jax.set_mesh(mesh):
        prefill, prefilled = _compile_prefill(params, prompt_PT, lengths_P, rng, static)
        limit_R = per_row((rows,), np.int32)
        lowered = engine.begin_turns_jit.lower(
            params, prefilled, lengths_P, rng, eos, limit_R, **static
        )
        begin = lowered.compile()
        turns = _outputs(lowered, begin)[0]
        given = engine.Given(
            per_row((rows,), bool), limit_R, per_row((rows, N), np.int32), per_row((rows, N), bool)
        )
        resume = engine.continue_turns_jit.lower(params, turns, rng, eos, given, **static)
        resume = resume.compile()
    return prefill, begin, resume, plan


def pool_tp(mesh, spec) -> int:
    """How many ways the pool's kv heads split: tp, or 1 when rows split over tp instead."""
    return 1 if spec.dp_attention else dict(mesh.shape).get("tp", 1)


def page_bytes_per_chip(mc, page_size: int, tp: int) -> int:
    """One page of every layer's pool on one chip: its kv heads split over tp."""
    heads = 2 * mc.num_kv_heads // tp
    return page_size * heads * mc.head_dim * mc.num_layers * np.dtype(mc.dtype).itemsize


def paged_meta(plan, spec, mc, mesh, reports) -> dict:
    """The paged engine's layout in the report: pages, concurrency, pool and peak per chip.

    `headroom_gib_per_chip`: HBM left with the decode program and the resident train state
    (the decode's temporaries may hold the pool more than once: its peak is the measure).
    """
    page = page_bytes_per_chip(mc, spec.page_size, pool_tp(mesh, spec))
    pool = plan.pages * page
    meta = {
        "page_size": spec.page_size,
        "pages_per_shard": plan.pages,
        "kv_pages": plan.pages * plan.shards,
        "data_shards": plan.shards,
        "concurrent_rows": plan.slots * plan.shards,
        "rows_per_call": plan.rows * plan.shards,
        "attention": plan.impl,
        "pool_gib_per_chip": pool / GiB,
    }
    decode = next((r for r in reports if r.name == "sampler decode" and not r.error), None)
    update = next((r for r in reports if r.name == "train update" and not r.error), None)
    if decode is not None:
        resident = update.argument_bytes if update is not None else 0
        meta["decode_peak_gib_per_chip"] = decode.peak_bytes / GiB
        meta["decode_peak_with_train_state_gib_per_chip"] = (decode.peak_bytes + resident) / GiB
        free = decode.hbm_bytes - decode.code_bytes - resident - decode.peak_bytes
        meta["headroom_gib_per_chip"] = free / GiB
    return meta


def paged_note(plan, spec, mc, mesh) -> str:
    """One line: the pool and the rows decoded at once."""
    pool = plan.pages * page_bytes_per_chip(mc, spec.page_size, pool_tp(mesh, spec)) / GiB
    return (
        f"{plan.pages} pages of {spec.page_size} tokens per data shard ({pool:.1f} GiB per "
        f"chip), {plan.slots * plan.shards} rows at once, attention {plan.impl}"
    )


def compile_lora_merge(state, state_sh, dst_shardings, mesh, spec, dtype):
    """LoRA's weights for the sampler: base + scale A B, in `dtype`, onto the sampler's mesh."""
    from ebpo_jax.models import lora

    merge = lambda base, adapters: lora.merge(base, adapters, spec, dtype=dtype)
    with jax.set_mesh(mesh):
        jitted = jax.jit(merge, out_shardings=dst_shardings)
        args = abstract(state.base, state_sh.base), abstract(state.params, state_sh.params)
        return jitted.lower(*args).compile()


def compile_reshard(params, src_shardings, dst_shardings, mesh, dtype):
    """Weights from the trainer's mesh to the sampler's, device to device, in the compute dtype.

    The cast halves what every decoded token reads when the master weights are float32.
    """
    cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
    with jax.set_mesh(mesh):
        jitted = jax.jit(cast, out_shardings=dst_shardings)
        return jitted.lower(abstract(params, src_shardings)).compile()


def resolve_for(config, topology: str, *, sampler_mesh="", trainer_devices: int = 0) -> RunSpec:
    """The RunSpec of `config` on `topology`'s devices, with the sampler layout under test.

    `trainer_devices=n` splits the topology as rollout.max_staleness=1 does: the trainer's
    mesh on the first n devices, `sampler_mesh` on the ones after them.
    """
    _, _, devices = topology_devices(topology)
    if sampler_mesh != config.sampler.mesh:
        config = config.copy_and_resolve_references()
        config.sampler.mesh = sampler_mesh
    if trainer_devices:
        config = config.copy_and_resolve_references()
        config.mesh.devices, config.rollout.max_staleness = trainer_devices, 1
    return resolve(config, len(devices))


def _attempter(reports: list, hbm: int, peak: float, log):
    """attempt(name, mesh, flops, note, compile_fn): compile and append its report; an
    out-of-memory compile (RESOURCE_EXHAUSTED) is a report with `error` set, None returned."""

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

    return attempt


def _refilled_estimate(spec, mc, hw, s_mesh, prompt_len, generated_per_kept):
    """The step estimate; with DAPO's dynamic sampling, its refill rounds decode one after
    another (`generated_per_kept`, None = DAPO_GENERATED_PER_KEPT)."""
    est = _estimate(spec, mc, hw, s_mesh, prompt_len)
    if not spec.rollout.dapo.dynamic_sampling:
        return est
    return with_refill(est, generated_per_kept or DAPO_GENERATED_PER_KEPT)


def run(
    spec: RunSpec,
    topology: str,
    *,
    prompt_len: int,
    sampler_prompts=None,
    update_only: bool = False,
    generated_per_kept: float | None = None,
    estimate_only: bool = False,
    log=print,
):
    """Compile update, weight reshard (onto the spec's sampler mesh) and sampler prefill/decode
    (`update_only`: the update alone, e.g. for a full vs LoRA memory comparison) for a spec
    from `resolve_for`. With a disjoint sampler mesh the weight move is a cast on the
    trainer's slice and a device-to-device copy, not one compiled program.

    `generated_per_kept` (DAPO's dynamic sampling only): tokens generated per kept token in
    the step estimate; None = aot_report.DAPO_GENERATED_PER_KEPT. `estimate_only`: the step
    estimate and layout, nothing compiled.

    Returns (reports, meta). A program the compiler cannot fit (RESOURCE_EXHAUSTED) gets a
    report with `error` set and fits=False; other compile errors propagate.
    """
    hw, chip_name, devices = topology_devices(topology)
    chips = math.prod(int(x) for x in chip_name.split(":")[1].split("x"))
    per_chip = max(1, len(devices) // chips)  # v4 topologies list each TensorCore
    reports = []
    attempt = _attempter(reports, hw.hbm_bytes // per_chip, hw.peak_flops / per_chip, log)
    mc = model_config_of(spec)
    mesh = make_mesh(spec.mesh, devices[: spec.mesh.mesh.devices or len(devices)])
    s_mesh = make_sampler_mesh(spec.mesh, mesh, devices)
    epochs = (
        f"{spec.update.loss.ppo_epochs} epoch(s) x {spec.update.loss.num_minibatches} mini-batches"
    )
    estimate = _refilled_estimate(spec, mc, hw, s_mesh, prompt_len, generated_per_kept)
    meta = {"step_estimate": estimate, "topology": topology, "chip_topology": chip_name}
    meta |= _layout_meta(spec, mc, devices, (mesh, s_mesh), prompt_len)
    if estimate_only:
        return reports, meta
    step, state, _ = make_step(spec, mc, mesh, prompt_len, devices)
    attempt(
        "train update",
        mesh,
        update_flops(spec, mc, prompt_len),
        epochs,
        lambda: compile_update(spec, mc, mesh, prompt_len, devices)[0],
    )
    if update_only:
        log("update_only: no weight move or sampler programs compiled")
        return reports, meta
    params = _compile_weight_move(attempt, spec, mc, step, state, mesh, s_mesh)
    abstract_params = abstract(params, step.sh.sampler_params)
    prompts = sampler_prompts or spec.rollout.prompts_per_call
    paged = _compile_sampler_programs(
        attempt, reports, spec.rollout, mc, (s_mesh, abstract_params), prompts, prompt_len
    )
    if paged is not None:
        meta["paged"] = paged
    return reports, meta


def _compile_sampler_programs(attempt, reports, ro, mc, on, prompts: int, prompt_len: int):
    """Compile the sampler's prefill and decode on `on` = (sampler mesh, abstract params);
    returns the paged KV cache's report fields (None when prefill does not fit)."""
    if ro.rollout.max_turns > 1:
        return _compile_turn_programs(attempt, reports, ro, mc, on, prompts, prompt_len)
    s_mesh, params = on
    calls = math.ceil(ro.prompts / prompts)
    note = f"{prompts} prompts x {ro.group_size} per call, {calls} call(s) per step"
    s_spec = sampler_spec_of(ro, 1)  # the stop id's value does not change the program
    sflops = sampler_flops(mc, prompts, ro.group_size, prompt_len, ro.max_new_tokens)
    compiled = {}

    def sampler_programs():
        compiled["prefill"], compiled["decode"], compiled["plan"] = compile_sampler(
            s_spec, mc, s_mesh, params, prompts, prompt_len
        )
        return compiled["prefill"]

    if attempt("sampler prefill", s_mesh, sflops["prefill"], note, sampler_programs) is None:
        return None
    attempt("sampler decode", s_mesh, sflops["decode"], note, lambda: compiled["decode"])
    reports[-1].note += "; " + paged_note(compiled["plan"], s_spec, mc, s_mesh)
    return paged_meta(compiled["plan"], s_spec, mc, s_mesh, reports)


def _compile_turn_programs(attempt, reports, ro, mc, on, prompts: int, prompt_len: int):
    """Multi-turn episodes: the TurnSession's prefill, first and continued turn on `on`, for
    a call of prompts x G rows (the host turn loop runs between them)."""
    s_mesh, params = on
    rows = prompts * ro.group_size
    note = f"{rows} episodes per call, {math.ceil(ro.prompts / prompts)} call(s) per step"
    s_spec = episodes.session_spec(ro, 1, ())
    sflops = sampler_flops(mc, rows, 1, prompt_len, ro.max_new_tokens)
    compiled = {}

    def programs():
        names = ("prefill", "begin", "resume", "plan")
        compiled.update(zip(names, compile_turns(s_spec, mc, s_mesh, params, rows, prompt_len)))
        return compiled["prefill"]

    if attempt("sampler prefill", s_mesh, sflops["prefill"], note, programs) is None:
        return None
    attempt("sampler first turn", s_mesh, sflops["decode"], note, lambda: compiled["begin"])
    attempt("sampler decode", s_mesh, sflops["decode"], "a continued turn: " + note,
            lambda: compiled["resume"])  # fmt: skip
    reports[-1].note += "; " + paged_note(compiled["plan"], s_spec, mc, s_mesh)
    return paged_meta(compiled["plan"], s_spec, mc, s_mesh, reports)


def _compile_weight_move(attempt, spec, mc, step, state, mesh, s_mesh):
    """Compile the sampler's weights from the train state (LoRA merge, or reshard / cast when
    the sampler has its own mesh); returns the sampler's abstract params."""
    params = state.params
    train_sh, samp_sh = step.sh.state.params, step.sh.sampler_params
    l_spec = spec.update.lora
    if l_spec is not None:  # the sampler runs LoRA's merged weights in the compute dtype
        merged = models.abstract_params(mc)
        attempt(
            "lora merge",
            s_mesh,
            0,
            f"base + A B to {mc.dtype}",
            lambda: compile_lora_merge(state, step.sh.state, samp_sh, s_mesh, l_spec, mc.dtype),
        )
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, mc.dtype), merged)
    if s_mesh is mesh:
        return params
    split = spec.mesh.disjoint  # cast where the weights are; the copy is a transfer
    dst, on = (train_sh, mesh) if split else (samp_sh, s_mesh)
    attempt(
        "cast weights" if split else "reshard weights",
        on,
        0,
        f"to {mc.dtype}" + (", then copied to the sampler's slice" if split else ""),
        lambda: compile_reshard(params, train_sh, dst, on, mc.dtype),
    )
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, mc.dtype), params)


def _estimate(spec, mc, hw, s_mesh, prompt_len):
    """The step-time estimate on the sampler mesh's data shards and tp."""
    from ebpo_jax.sampler import layout

    shards = layout.data_size(s_mesh, None, mc.sharding_rules)
    tp = dict(s_mesh.shape).get("tp", 1)
    dp = spec.rollout.sampler.dp_attention
    return step_time_estimate(
        spec, mc, hw, prompt_len=prompt_len, shards=shards, tp=tp, dp_attention=dp
    )


def _layout_meta(spec, mc, devices, meshes, prompt_len):
    """The report's JSON fields on the model, the devices and the meshes."""
    mesh, s_mesh = meshes
    return {
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "model": dataclasses.asdict(mc),
        "params": total_params(mc),
        "prompt_len": prompt_len,
        "max_new_tokens": spec.rollout.max_new_tokens,
        "sequences_per_step": spec.rollout.prompts * spec.rollout.group_size,
        "train_mesh": dict(mesh.shape),
        "sampler_mesh": dict(s_mesh.shape),
        "split": bool(spec.mesh.disjoint),
        "flops_note": "analytic model FLOPs (6NT + causal attention); cost_analysis() counts a "
        "scanned layer once; remat recompute not included",
    }
