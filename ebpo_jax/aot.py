"""Ahead-of-time compilation for TPU pods on a CPU host: topology names, FLOPs, memory report.

The programs compiled are the trainer's own (`make_update_fn`) and the sampler's own jitted
prefill/decode, lowered with abstract inputs (`jax.ShapeDtypeStruct` + sharding): no weights
are ever allocated. `compiled.cost_analysis()` counts a scanned layer body once, so FLOPs
here are analytic (6 N T plus attention), computed from the model config.
"""

import dataclasses
import json
import math
import re

import jax
import numpy as np

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Per-chip facts: HBM, bf16 peak, HBM bandwidth, and how names count it."""

    generation: str
    hbm_bytes: int
    peak_flops: float  # bf16 dense FLOP/s
    hbm_bandwidth: float  # bytes/s
    cores_in_name: int  # `v5p-64` counts TensorCores: 2 per chip on v4/v5p
    torus_dims: int  # 3 for v4/v5p, 2 for v5e/v6e


CHIPS = {
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1.2e12, 2, 3),
    "v5p": ChipSpec("v5p", 95 * GiB, 459e12, 2.765e12, 2, 3),
    "v5e": ChipSpec("v5e", 16 * GiB, 197e12, 0.819e12, 1, 2),
    "v6e": ChipSpec("v6e", 32 * GiB, 918e12, 1.64e12, 1, 2),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6litepod": "v6e", "v6lite": "v6e"}
_NAME_RE = re.compile(r"^(v\w+?)-(\d+)$")
_CHIP_RE = re.compile(r"^(v\w+?):(\d+(?:x\d+){1,2})$")


def known_topologies() -> str:
    """A one-line description of the accepted topology names, for error messages."""
    gens = "/".join(CHIPS)
    return (
        f"accelerator names <gen>-<n> with gen in {gens} (or v5litepod/v6litepod), e.g. "
        "v5p-64 (n = TensorCores: 32 chips), v5e-64 / v6e-64 (n = chips); or chip "
        "topologies <gen>:AxB[xC], e.g. v5p:2x4x4, v5e:8x8"
    )


def _torus(chips: int, dims: int) -> tuple[int, ...]:
    """Cloud TPU slice shape for a power-of-two chip count: double the smallest dim (last on ties)."""
    shape = [1] * dims
    while math.prod(shape) < chips:
        i = max(i for i, s in enumerate(shape) if s == min(shape))
        shape[i] *= 2
    if dims == 3 and shape[-1] == 2 and shape[0] == 1:  # 4 chips is 2x2x1, not 1x2x2
        shape = [2, 2, 1]
    return tuple(shape)


def chip_topology(name: str) -> tuple[ChipSpec, str]:
    """(chip spec, `gen:AxBxC` name for get_topology_desc) for a user-typed topology name."""
    name = name.strip().lower()
    if m := _CHIP_RE.match(name):
        gen = _ALIASES.get(m.group(1), m.group(1))
        if gen not in CHIPS:
            raise ValueError(f"unknown TPU generation in {name!r}; known: {known_topologies()}")
        dims = tuple(int(d) for d in m.group(2).split("x"))
        if len(dims) != CHIPS[gen].torus_dims:
            raise ValueError(
                f"{gen} topologies have {CHIPS[gen].torus_dims} dims, got {name!r}; "
                f"known: {known_topologies()}"
            )
        return CHIPS[gen], f"{gen}:{m.group(2)}"
    m = _NAME_RE.match(name)
    if not m or _ALIASES.get(m.group(1), m.group(1)) not in CHIPS:
        raise ValueError(f"unknown topology {name!r}; known: {known_topologies()}")
    spec = CHIPS[_ALIASES.get(m.group(1), m.group(1))]
    n = int(m.group(2))
    chips = n // spec.cores_in_name
    smallest = 4  # one host's 2x2 (x1) chips: the smallest slice get_topology_desc builds
    if n % spec.cores_in_name or chips < smallest or chips & (chips - 1):
        raise ValueError(
            f"topology {name!r}: {n} is not a power-of-two slice of >= {smallest} chips "
            f"({spec.cores_in_name} per chip in the name); known: {known_topologies()}"
        )
    shape = _torus(chips, spec.torus_dims)
    return spec, f"{spec.generation}:{'x'.join(map(str, shape))}"


def topology_devices(name: str):
    """(chip spec, chip-topology name, TPU devices) built on this host without TPUs (needs libtpu)."""
    from jax.experimental import topologies

    spec, chip_name = chip_topology(name)
    desc = topologies.get_topology_desc(platform="tpu", topology_name=chip_name)
    return spec, chip_name, list(desc.devices)


def libtpu_available() -> str | None:
    """None when TPU topologies can be built here, else the reason they cannot."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed (pip install -e '.[tpu]')"
    return None


# ---------------------------------------------------------------- analytic FLOPs


def matmul_params(mc) -> dict[str, int]:
    """Matmul parameter counts: per layer (attention + MLP) and the output head."""
    D, H, K, Dh, F = (
        mc.hidden_size,
        mc.num_heads,
        mc.num_kv_heads,
        mc.head_dim,
        mc.intermediate_size,
    )
    per_layer = D * Dh * (2 * H + 2 * K) + 3 * D * F
    return {"layers": mc.num_layers * per_layer, "head": D * mc.vocab_size}


def total_params(mc) -> int:
    """Every parameter, embeddings included (norms too), as a count."""
    m = matmul_params(mc)
    norms = mc.num_layers * (2 * mc.hidden_size + (2 * mc.head_dim if mc.qk_norm else 0))
    embed = mc.vocab_size * mc.hidden_size
    head = 0 if mc.tie_word_embeddings else m["head"]
    return m["layers"] + head + embed + norms + mc.hidden_size


def attention_flops(mc, q_len: int, kv_len: int, *, causal: bool) -> float:
    """Forward QK^T and PV FLOPs of one sequence over all layers (causal: half the square)."""
    pairs = q_len * kv_len / 2 if causal else q_len * kv_len
    return 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * pairs


def update_flops(config, mc, prompt_len: int) -> float:
    """Model FLOPs of one update step (every PPO epoch and mini-batch); remat recompute excluded."""
    P, G = config.prompts_per_step, config.group_size
    N = config.sampler.max_new_tokens
    T = prompt_len + N
    m = matmul_params(mc)
    # The forward runs at the padded width T; the head only on the N completion positions.
    fwd = 2.0 * m["layers"] * T + attention_flops(mc, T, T, causal=True) + 2.0 * m["head"] * N
    ref = fwd if config.loss.kl_coef > 0 else 0.0
    return config.loss.ppo_epochs * P * G * (3.0 * fwd + ref)


def sampler_flops(mc, prompts: int, samples: int, prompt_len: int, new_tokens: int) -> dict:
    """Model FLOPs of one generate call: prefill (logits at every prompt slot) and decode."""
    m = matmul_params(mc)
    S = prompt_len + new_tokens
    prefill = prompts * (
        2.0 * (m["layers"] + m["head"]) * prompt_len
        + attention_flops(mc, prompt_len, prompt_len, causal=True)
    )
    per_token = 2.0 * (m["layers"] + m["head"]) + attention_flops(mc, 1, S, causal=False)
    decode = prompts * samples * (new_tokens - 1) * per_token
    return {"prefill": prefill, "decode": decode}


# ---------------------------------------------------------------- memory report


@dataclasses.dataclass
class ProgramReport:
    """Per-device memory of one compiled program and its FLOPs at the chip's peak."""

    name: str
    mesh: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    hbm_bytes: int
    flops_per_device: float
    peak_flops: float
    note: str = ""

    @property
    def peak_bytes(self) -> int:
        """Live at once: arguments, outputs not aliased to (donated) arguments, temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes + self.code_bytes <= self.hbm_bytes

    @property
    def time_at_peak_s(self) -> float:
        return self.flops_per_device / self.peak_flops

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(peak_bytes=self.peak_bytes, fits=self.fits, time_at_peak_s=self.time_at_peak_s)
        return d


def report_from_compiled(name, compiled, mesh, hbm_bytes, flops_total, peak_flops, note=""):
    """A ProgramReport from `compiled.memory_analysis()` (bytes are per device)."""
    ma = compiled.memory_analysis()
    return ProgramReport(
        name=name,
        mesh=" x ".join(f"{a}={s}" for a, s in mesh.shape.items()),
        argument_bytes=int(ma.argument_size_in_bytes),
        output_bytes=int(ma.output_size_in_bytes),
        alias_bytes=int(ma.alias_size_in_bytes),
        temp_bytes=int(ma.temp_size_in_bytes),
        code_bytes=int(ma.generated_code_size_in_bytes),
        hbm_bytes=int(hbm_bytes),
        flops_per_device=float(flops_total) / mesh.size,
        peak_flops=float(peak_flops),
        note=note,
    )


def format_table(reports: list[ProgramReport]) -> str:
    """The per-device report as a fixed-width text table (GiB, TFLOP, seconds)."""
    head = ("program", "mesh", "args", "out", "temp", "peak", "HBM", "fits", "TFLOP", "t@peak s")
    rows = [head]
    for r in reports:
        g = lambda b: f"{b / GiB:.2f}"
        rows.append(
            (
                r.name,
                r.mesh,
                g(r.argument_bytes),
                g(r.output_bytes - r.alias_bytes),
                g(r.temp_bytes),
                g(r.peak_bytes),
                g(r.hbm_bytes),
                "yes" if r.fits else "NO",
                f"{r.flops_per_device / 1e12:.1f}",
                f"{r.time_at_peak_s:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, reports: list[ProgramReport], **meta) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "programs": [r.as_dict() for r in reports]}, f, indent=2)


def is_resource_exhausted(err: BaseException) -> bool:
    """True for the compiler's out-of-memory error (the program does not fit in HBM)."""
    return "RESOURCE_EXHAUSTED" in str(err) or "Ran out of memory" in str(err)


def abstract(tree, shardings):
    """ShapeDtypeStruct leaves carrying `shardings` (a matching pytree or one sharding)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree
        )
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def bytes_of(tree) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


# ---------------------------------------------------------------- the programs


def model_config_of(config):
    """The policy ModelConfig the trainer would build (the preset's own vocabulary by default)."""
    from types import SimpleNamespace

    from ebpo_jax import models
    from ebpo_jax.trainer.loop import model_config_from

    vocab = models.PRESETS[config.model.preset]["vocab_size"]
    return model_config_from(config, SimpleNamespace(vocab_size=vocab))


def batch_sharded(tree, mesh, rows: int, rules=None):
    """Shardings splitting every leaf whose leading dim is `rows` over the batch axes."""
    from ebpo_jax import sharding

    def one(x):
        if x.ndim and x.shape[0] == rows:
            names = ("batch",) + (None,) * (x.ndim - 1)
            spec = sharding.logical_to_spec(names, rules, mesh, x.shape, "rollout")
            return jax.sharding.NamedSharding(mesh, spec)
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    return jax.tree.map(one, tree)


def train_state_shardings(config, optimizer, state, mesh):
    """Shardings of an (abstract) TrainState: params, ref params and Adam moments by the rules."""
    import optax

    from ebpo_jax import sharding

    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    p_sh = sharding.param_shardings(config, state.params, mesh)
    opt_sh = optax.tree_map_params(
        optimizer, lambda _, s: s, state.opt_state, p_sh, transform_non_params=lambda _: rep
    )
    return state._replace(
        params=p_sh,
        opt_state=opt_sh,
        eb_state=jax.tree.map(lambda _: rep, state.eb_state),
        step=rep,
        rng=rep,
        ref_params=None if state.ref_params is None else p_sh,
        nonfinite_run=rep,
        generated_tokens=rep,
    )


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
    state_sh = train_state_shardings(config, optimizer, state, mesh)
    ro_sh = batch_sharded(ro, mesh, config.prompts_per_step)
    update = make_update_fn(config, mc, optimizer, eos_id=1)
    jitted = jax.jit(
        update, in_shardings=(state_sh, ro_sh), out_shardings=(state_sh, None), donate_argnums=0
    )
    with jax.set_mesh(mesh):
        return jitted.lower(state, ro).compile(), state.params, state_sh.params


def compile_sampler(config, mc, mesh, params, prompts: int, prompt_len: int):
    """The sampler's own jitted prefill and decode for `prompts` prompts x G samples."""
    from ebpo_jax import sampler

    G, N = config.group_size, config.sampler.max_new_tokens
    s = config.sampler
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


def compile_reshard(params, src_shardings, dst_shardings, mesh):
    """Device-to-device resharding of the weights from the trainer's mesh to the sampler's."""
    with jax.set_mesh(mesh):
        return (
            jax.jit(lambda p: p, out_shardings=dst_shardings)
            .lower(abstract(params, src_shardings))
            .compile()
        )


def parse_mesh(text: str):
    """`data=8,tp=4` -> [("data", 8), ("tp", 4)] (-1 allowed once)."""
    try:
        pairs = [p.split("=") for p in text.split(",") if p]
        return [(a.strip(), int(s)) for a, s in pairs]
    except ValueError:
        raise ValueError(f"mesh {text!r} is not like 'data=8,tp=4'") from None


def run(config, topology: str, *, prompt_len: int, sampler_prompts=None, sampler_mesh=""):
    """Compile update, sampler (prefill, decode) and the weight reshard for `topology`.

    Returns (reports, meta). A program that does not fit raises the compiler's
    RESOURCE_EXHAUSTED error (see is_resource_exhausted) or reports fits=False.
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

    update, params, train_sh = compile_update(config, mc, mesh, prompt_len)
    reports = [
        report_from_compiled(
            "train update",
            update,
            mesh,
            hbm,
            update_flops(config, mc, prompt_len),
            peak,
            note=f"{config.loss.ppo_epochs} epoch(s) x {config.loss.num_minibatches} mini-batches",
        )
    ]
    del update
    samp_sh = sharding.param_shardings(config, params, s_mesh)
    if s_mesh is not mesh:
        reshard = compile_reshard(params, train_sh, samp_sh, s_mesh)
        reports.append(report_from_compiled("reshard weights", reshard, s_mesh, hbm, 0, peak))
    sflops = sampler_flops(mc, prompts, G, prompt_len, N)
    prefill, decode = compile_sampler(
        config, mc, s_mesh, abstract(params, samp_sh), prompts, prompt_len
    )
    calls = math.ceil(config.prompts_per_step / prompts)
    note = f"{prompts} prompts x {G} per call, {calls} call(s) per step"
    reports.append(
        report_from_compiled("sampler prefill", prefill, s_mesh, hbm, sflops["prefill"], peak, note)
    )
    decode_r = report_from_compiled(
        "sampler decode", decode, s_mesh, hbm, sflops["decode"], peak, note
    )
    # Decoding is bound by HBM bandwidth: every step reads the weights and the whole cache.
    decode_r.note += f"; >= {(N - 1) * decode_r.argument_bytes / spec.hbm_bandwidth * per_chip:.0f} s at HBM bandwidth"
    reports.append(decode_r)
    meta = {
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
