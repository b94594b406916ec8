"""Ahead-of-time compilation of the real programs for a TPU topology, on a CPU host.

The programs are the loop's own: its runner's update, its weight move (trainer/policy.py's
SamplerWeights: LoRA merge, cast, reshard) and the sampler's programs for a call
(sampler.Session: prefill and decode, or the turns), lowered with abstract inputs
(`jax.ShapeDtypeStruct` + sharding): no weights are ever allocated. The report (memory per
device, analytic FLOPs) is in aot_report.
"""

import dataclasses
import functools
import math
import time

import jax
import numpy as np

from ebpo_jax import sampler
from ebpo_jax.pods.aot_memo import compile_with
from ebpo_jax.pods.aot_report import (
    DAPO_GENERATED_PER_KEPT,
    ProgramReport,
    SamplerLayout,
    exact_on_policy_terms,
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
from ebpo_jax.sampler import pages
from ebpo_jax.sharding import abstract, make_mesh
from ebpo_jax.spec import RunSpec, resolve
from ebpo_jax.tasks import episodes
from ebpo_jax.tasks.protocol import Reward, Task, model_config_from
from ebpo_jax.trainer import policy
from ebpo_jax.trainer.runners import make_runner
from ebpo_jax.trainer.shardings import bundle, make_sampler_mesh
from ebpo_jax.trainer.state import make_optimizer


def model_config_of(spec: RunSpec, vocab_size: int = 0):
    """The policy ModelConfig the trainer would build for a tokenizer of `vocab_size` ids (0:
    the preset's own, as the pods' HF checkpoints have; a synthetic family's char tokenizer
    has fewer): AOT has no data, so the vocabulary, like the prompt width, is an input."""
    from ebpo_jax import models

    vocab = vocab_size or models.PRESETS[spec.task.model.preset]["vocab_size"]
    return model_config_from(spec.task.model, vocab)


# What only a run's data says, which AOT (with none) takes as given: a math run's answer width
# and stop ids (their count shapes the programs, not their values), as keywords of make_step.
MATH_DATA = {"answer_len": 64, "stop_ids": (1,)}  # short answers: no memory moves with them


def shape_task(spec: RunSpec, mc, params, stop_ids=MATH_DATA["stop_ids"]) -> Task:
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
        stop_ids=stop_ids,
        evaluate=None,
    )


def abstract_inputs(spec: RunSpec, mc, prompt_len: int, *, answer_len: int, stop_ids):
    """(abstract TrainState, abstract Rollout, optimizer) at the spec's shapes: no allocation."""
    from ebpo_jax import models, tasks

    optimizer = make_optimizer(spec.optim)
    params = models.abstract_params(mc)
    init = lambda p: policy.of(spec, mc).init(p, optimizer, seed=spec.run.seed)
    state = jax.eval_shape(init, params)
    n = spec.rollout.batch_prompts
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, np.int32)
    batch = tasks.PromptBatch(
        i32(n, prompt_len), i32(n), i32(n, answer_len), i32(n), i32(n), i32(n), i32(n)
    )
    task = shape_task(spec, mc, params, stop_ids)
    rollout = make_rollout_fn(spec.rollout, mc, None, task.stop_ids, task.cluster_ids)
    ro = jax.eval_shape(rollout, params, batch, jax.random.key(0))
    return state, ro, optimizer


def make_step(spec: RunSpec, mc, mesh, prompt_len: int, devices=None, **data):
    """The loop's own runner (jitted rollout and update with the run's shardings), abstractly.

    `devices`: every device of the topology (a split run's sampler takes those after the mesh).
    `data`: answer_len and stop_ids when not a math run's (MATH_DATA).
    """
    data = MATH_DATA | data
    state, ro, optimizer = abstract_inputs(spec, mc, prompt_len, **data)
    view = policy.of(spec, mc)  # the one policy view, as the loop's
    sh = bundle(spec, view, optimizer, state, mesh, devices)
    task = shape_task(spec, mc, state.params, data["stop_ids"])
    step = make_runner(spec, task, optimizer, sh, view)
    # Inputs carry the loop's shardings, as its placed arrays do: the same program is traced.
    return step, abstract(state, sh.state), abstract(ro, sh.rollout)


def compile_update(step, state, ro, mesh, memo=None):
    """The trainer's own jitted update (the loop's runner.update, from make_step) lowered on
    its abstract inputs and compiled (through `memo`, a pods.aot_memo.Memo, when given)."""
    with jax.set_mesh(mesh):
        return compile_with(memo, step.update.lower(state, ro), mesh)


def compile_sampler(spec, mc, mesh, params, prompts: int, prompt_len: int, *, turns=False,
                    memo=None):  # fmt: skip
    """The sampler's own programs for a call of `prompts` prompts (sampler.Session.compile):
    name -> (Traced, Lowered, Compiled), and "plan" -> the Plan (pages per shard, slots)."""
    session = sampler.Session(mc, spec, mesh=mesh, turns=turns)
    return session.compile(params, prompts, prompt_len, compile_fn=_via(memo, mesh))


def _via(memo, mesh):
    """compile_fn(lowered) for `mesh`'s programs: through `memo` when there is one."""
    return lambda lowered: compile_with(memo, lowered, mesh)


def pool_tp(mesh, spec) -> int:
    """How many ways the pool's kv heads split: tp, or 1 when rows split over tp instead."""
    return 1 if spec.dp_attention else dict(mesh.shape).get("tp", 1)


def page_bytes_per_chip(mc, page_size: int, tp: int, kv_dtype: str = "") -> float:
    """One page of every layer's pool on one chip: its kv heads split over tp (int8: and the
    scales)."""
    return pages.page_bytes(mc, page_size, kv_dtype, mc.num_kv_heads // tp)


def paged_meta(plan, spec, mc, mesh, reports) -> dict:
    """The paged engine's layout in the report: pages, concurrency, pool and peak per chip.

    `headroom_gib_per_chip`: HBM left with the decode program and the resident train state
    (the decode's temporaries may hold the pool more than once: its peak is the measure).
    """
    page = page_bytes_per_chip(mc, spec.page_size, pool_tp(mesh, spec), spec.kv_dtype)
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
    page = page_bytes_per_chip(mc, spec.page_size, pool_tp(mesh, spec), spec.kv_dtype)
    pool = plan.pages * page / GiB
    return (
        f"{plan.pages} pages of {spec.page_size} tokens per data shard ({pool:.1f} GiB per "
        f"chip), {plan.slots * plan.shards} rows at once, attention {plan.impl}"
    )


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
        how = "reused" if getattr(compiled, "reused", False) else "compiled"
        log(f"{name}: {how} in {time.perf_counter() - t0:.0f} s")
        return compiled

    return attempt


def _compiler(attempt, memo=None):
    """build(name, mesh, note, traced) for SamplerWeights.programs: compiled under `attempt`."""
    return lambda name, on, note, traced: attempt(
        name, on, 0, note, lambda: compile_with(memo, traced.lower(), on)
    )


def _refilled_estimate(spec, mc, hw, s_mesh, prompt_len, generated_per_kept):
    """The step estimate; with DAPO's dynamic sampling, its refill rounds decode one after
    another (`generated_per_kept`, None = DAPO_GENERATED_PER_KEPT)."""
    est = _estimate(spec, mc, hw, s_mesh, prompt_len)
    if spec.rollout.dapo.dynamic_sampling:
        est = with_refill(est, generated_per_kept or DAPO_GENERATED_PER_KEPT)
    chips, peak = s_mesh.devices.size, hw.peak_flops
    return exact_on_policy_terms(est, spec, mc, prompt_len=prompt_len, devices=chips, peak=peak)


# What `run` compiles: everything, the update alone (e.g. for a full vs LoRA memory
# comparison), or nothing (the step estimate and layout only).
PROGRAMS = ("all", "update", "none")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the programs and the estimate are sized for."""

    prompt_len: int
    sampler_prompts: int | None = None  # per sampler call; None: the rollout's prompts_per_call
    # DAPO's dynamic sampling: tokens generated per kept token in the step estimate
    # (None: aot_report.DAPO_GENERATED_PER_KEPT).
    generated_per_kept: float | None = None


def run(spec: RunSpec, topology: str, work: Workload, *, programs="all", memo=None, log=print):
    """Compile update, weight reshard (onto the spec's sampler mesh) and sampler prefill/decode
    (or fewer, by `programs`: one of PROGRAMS) for a spec from `resolve_for`. With a disjoint
    sampler mesh the weight move is a cast on the trainer's slice and a device-to-device
    copy, not one compiled program. `memo` (a pods.aot_memo.Memo): a program compiled
    before, byte for byte, is reused from it; each report says which.

    Returns (reports, meta). A program the compiler cannot fit (RESOURCE_EXHAUSTED) gets a
    report with `error` set and fits=False; other compile errors propagate.
    """
    if programs not in PROGRAMS:
        raise ValueError(f"programs={programs!r}: expected one of {PROGRAMS}")
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
    prompt_len = work.prompt_len
    estimate = _refilled_estimate(spec, mc, hw, s_mesh, prompt_len, work.generated_per_kept)
    meta = {"step_estimate": estimate, "topology": topology, "chip_topology": chip_name}
    meta |= _layout_meta(spec, mc, devices, (mesh, s_mesh), prompt_len)
    if programs == "none":
        return reports, meta
    step, state, ro = make_step(spec, mc, mesh, prompt_len, devices)
    attempt(
        "train update",
        mesh,
        update_flops(spec, mc, prompt_len),
        epochs,
        lambda: compile_update(step, state, ro, mesh, memo),
    )
    if programs == "update":
        log("programs=update: no weight move or sampler programs compiled")
        return reports, meta
    # The loop's own weight move (trainer/policy.py decides LoRA merge, cast and reshard).
    abstract_params = step.pieces.weights.programs(state, _compiler(attempt, memo))
    prompts = work.sampler_prompts or spec.rollout.prompts_per_call
    paged = _compile_sampler_programs(
        attempt, reports, spec.rollout, mc, (s_mesh, abstract_params, memo), prompts, prompt_len
    )
    if paged is not None:
        meta["paged"] = paged
    return reports, meta


def sampler_call(ro, prompts: int):
    """(SamplerSpec, rows, turns) of one sampler call of `prompts` prompts as the rollout makes
    it (multi-turn: a Session of prompts x G episodes); the stop id's value changes no program."""
    if ro.rollout.max_turns > 1:
        return episodes.session_spec(ro, 1, ()), prompts * ro.group_size, True
    return sampler_spec_of(ro, 1), prompts, False


def _compile_sampler_programs(attempt, reports, ro, mc, on, prompts: int, prompt_len: int):
    """Compile the sampler's programs (sampler.Session's) on `on` = (sampler mesh, abstract
    params, memo or None); returns the paged KV cache's report fields (None when prefill does not fit).
    Multi-turn episodes: prefill, first and continued turn (the host turn loop runs between)."""
    s_mesh, params, memo = on
    calls = math.ceil(ro.prompts / prompts)
    s_spec, rows, turns = sampler_call(ro, prompts)
    if turns:
        note = f"{rows} episodes per call, {calls} call(s) per step"
        names = [("begin", "sampler first turn", note), ("resume", "sampler decode",
                 "a continued turn: " + note)]  # fmt: skip
    else:
        note = f"{prompts} prompts x {ro.group_size} per call, {calls} call(s) per step"
        names = [("decode", "sampler decode", note)]
    G = s_spec.num_samples
    sflops = sampler_flops(mc, rows, G, prompt_len, ro.max_new_tokens)
    compiled = {}

    def programs():
        compiled.update(
            compile_sampler(s_spec, mc, s_mesh, params, rows, prompt_len, turns=turns, memo=memo)
        )
        return compiled["prefill"][2]

    if attempt("sampler prefill", s_mesh, sflops["prefill"], note, programs) is None:
        return None
    for key, name, what in names:
        attempt(name, s_mesh, sflops["decode"], what, lambda key=key: compiled[key][2])
    reports[-1].note += "; " + paged_note(compiled["plan"], s_spec, mc, s_mesh)
    return paged_meta(compiled["plan"], s_spec, mc, s_mesh, reports)


def _estimate(spec, mc, hw, s_mesh, prompt_len):
    """The step-time estimate on the sampler mesh's data shards and tp."""
    from ebpo_jax.sampler import layout

    shards = layout.data_size(s_mesh, None, mc.sharding_rules)
    tp = dict(s_mesh.shape).get("tp", 1)
    sampler = spec.rollout.sampler
    layout = SamplerLayout(shards, tp, sampler.dp_attention, sampler.expert_parallel)
    return step_time_estimate(spec, mc, hw, prompt_len=prompt_len, layout=layout)


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
