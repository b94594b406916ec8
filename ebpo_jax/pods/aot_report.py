"""TPU chips and topology names, analytic FLOPs, and the per-device memory report of AOT.

GPU nodes (H100, H200) are described in ebpo_jax.pods.gpu_topology and dispatched to from here.

`compiled.cost_analysis()` counts a scanned layer body once, so FLOPs here are analytic
(6 N T plus attention), computed from the model config.
"""

import dataclasses
import json
import math
import os
import re
from typing import NamedTuple

from ebpo_jax.pods import step_terms
from ebpo_jax.pods.hardware import ChipSpec, GiB
from ebpo_jax.pods.step_terms import ElementBytes

# ICI: half the bidirectional bandwidth per chip of the Cloud TPU pages (v5p 1200 GB/s, v5e
# 400, v6e 800); v4's page gives none, so it is taken as half v5p's.
CHIPS = {
    "v4": ChipSpec("v4", 32 * GiB, 275e12, 1.2e12, 2, 3, 300e9),
    "v5p": ChipSpec("v5p", 95 * GiB, 459e12, 2.765e12, 2, 3, 600e9),
    "v5e": ChipSpec("v5e", 16 * GiB, 197e12, 0.819e12, 1, 2, 200e9),
    "v6e": ChipSpec("v6e", 32 * GiB, 918e12, 1.64e12, 1, 2, 400e9),
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
        "topologies <gen>:AxB[xC], e.g. v5p:2x4x4, v5e:8x8; or GPU nodes "
        "[<nodes>x]<gpus>x<h100|h200>, e.g. 8xH100, 2x8xH100"
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
    """(chip spec, chip-topology name, devices) built on this host without TPUs or GPUs.

    TPU names need libtpu; GPU node names (`8xH100`, `2x8xH100`: ebpo_jax.pods.gpu_topology) the
    CUDA plugin.
    """
    from jax.experimental import topologies

    from ebpo_jax.pods import gpu_topology

    if gpu_topology.parse(name):
        return gpu_topology.topology_devices(name)
    spec, chip_name = chip_topology(name)
    # libtpu takes a machine-wide lock file as it loads; compiling for a topology here needs no
    # exclusive TPU.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    desc = topologies.get_topology_desc(platform="tpu", topology_name=chip_name)
    return spec, chip_name, list(desc.devices)


def compiler_unavailable(name: str) -> str | None:
    """None when topology `name` can be compiled for here, else the reason it cannot."""
    from ebpo_jax.pods import gpu_topology

    if gpu_topology.parse(name):
        return gpu_topology.cuda_plugin_available()
    return libtpu_available()


def libtpu_available() -> str | None:
    """None when TPU topologies can be built here, else the reason they cannot."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return "libtpu is not installed (pip install -e '.[tpu]')"
    return None


# ---------------------------------------------------------------- analytic FLOPs


def _ffn_params(mc, active: bool) -> int:
    """Feed-forward matmul parameters of all layers; of a mixture of experts, the router and
    the k experts a token runs (`active`) or all of them."""
    D, L = mc.hidden_size, mc.num_layers
    sparse = mc.num_sparse_layers if getattr(mc, "is_moe", False) else 0
    dense = (L - sparse) * 3 * D * mc.intermediate_size
    if not sparse:
        return dense
    experts = mc.num_experts_per_tok if active else mc.num_experts
    return dense + sparse * (D * mc.num_experts + experts * 3 * D * mc.moe_intermediate_size)


def matmul_params(mc) -> dict[str, int]:
    """Matmul parameter counts a token runs through: layers (attention + MLP or its active
    experts) and the output head."""
    D, H, K, Dh = mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim
    attn = mc.num_layers * D * Dh * (2 * H + 2 * K)
    return {"layers": attn + _ffn_params(mc, active=True), "head": D * mc.vocab_size}


def expert_params(mc) -> int:
    """The experts' SwiGLU weights of every sparse layer (0 for a dense model)."""
    if not getattr(mc, "is_moe", False):
        return 0
    return mc.num_sparse_layers * mc.num_experts * 3 * mc.hidden_size * mc.moe_intermediate_size


def total_params(mc) -> int:
    """Every parameter, embeddings included (norms too), as a count."""
    m = matmul_params(mc)
    m["layers"] += _ffn_params(mc, active=False) - _ffn_params(mc, active=True)
    norms = mc.num_layers * (2 * mc.hidden_size + (2 * mc.head_dim if mc.qk_norm else 0))
    embed = mc.vocab_size * mc.hidden_size
    head = 0 if mc.tie_word_embeddings else m["head"]
    return m["layers"] + head + embed + norms + mc.hidden_size


def attention_flops(mc, q_len: int, kv_len: int, *, causal: bool) -> float:
    """Forward QK^T and PV FLOPs of one sequence over all layers (causal: half the square)."""
    pairs = q_len * kv_len / 2 if causal else q_len * kv_len
    return 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * pairs


def update_flops(run_spec, mc, prompt_len: int) -> float:
    """Model FLOPs of one update step (every PPO epoch and mini-batch); remat recompute excluded."""
    P, G = run_spec.rollout.prompts, run_spec.rollout.group_size
    N = run_spec.rollout.max_new_tokens
    T = prompt_len + N
    m = matmul_params(mc)
    # The forward runs at the padded width T; the head only on the N completion positions.
    fwd = 2.0 * m["layers"] * T + attention_flops(mc, T, T, causal=True) + 2.0 * m["head"] * N
    ref = fwd if run_spec.update.loss.kl_coef > 0 else 0.0
    return run_spec.update.loss.ppo_epochs * P * G * (3.0 * fwd + ref)


def recompute_flops(run_spec, mc, prompt_len: int) -> float:
    """Model FLOPs of the old-log-prob recompute (loss.recompute_old_logprobs): one padded
    forward per step, each prompt once per group (forward_grouped), the head on completions."""
    P, G = run_spec.rollout.prompts, run_spec.rollout.group_size
    N = run_spec.rollout.max_new_tokens
    m = matmul_params(mc)
    attention = attention_flops(mc, prompt_len, prompt_len, causal=True)
    prompt = 2.0 * m["layers"] * prompt_len + attention
    comp = (
        2.0 * (m["layers"] + m["head"]) * N
        + attention_flops(mc, N, prompt_len, causal=False)
        + attention_flops(mc, N, N, causal=True)
    )
    return P * (prompt + G * comp)


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
    error: str = ""  # the compiler's RESOURCE_EXHAUSTED message when it does not fit
    memo: str = ""  # through pods/aot_memo.py: "compiled", or "reused from <run>"
    memo_key: str = ""

    @property
    def peak_bytes(self) -> int:
        """Live at once: arguments, outputs not aliased to (donated) arguments, temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        return not self.error and self.peak_bytes + self.code_bytes <= self.hbm_bytes

    @property
    def time_at_peak_s(self) -> float:
        return self.flops_per_device / self.peak_flops

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(peak_bytes=self.peak_bytes, fits=self.fits, time_at_peak_s=self.time_at_peak_s)
        return d


def mesh_str(mesh) -> str:
    return " x ".join(f"{a}={s}" for a, s in mesh.shape.items())


def report_from_compiled(name, compiled, mesh, hbm_bytes, flops_total, peak_flops, note=""):
    """A ProgramReport from `compiled.memory_analysis()` (bytes are per device)."""
    ma = compiled.memory_analysis()
    return ProgramReport(
        name=name,
        mesh=mesh_str(mesh),
        argument_bytes=int(ma.argument_size_in_bytes),
        output_bytes=int(ma.output_size_in_bytes),
        alias_bytes=int(ma.alias_size_in_bytes),
        temp_bytes=int(ma.temp_size_in_bytes),
        code_bytes=int(ma.generated_code_size_in_bytes),
        hbm_bytes=int(hbm_bytes),
        flops_per_device=float(flops_total) / mesh.size,
        peak_flops=float(peak_flops),
        note=note,
        memo=getattr(compiled, "how", ""),
        memo_key=getattr(compiled, "key", ""),
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


def resident_check(reports: list[ProgramReport]) -> tuple[list[str], list[str]]:
    """(lines, names that do not fit) for the sampler programs with the train state resident.

    The training state (and the rollout) stay in HBM while the sampler runs, so a sampler
    program fits only if its peak plus the update's arguments fits; each report alone
    does not say so.
    """
    update = next((r for r in reports if r.name == "train update" and not r.error), None)
    if update is None:
        return [], []
    lines, bad = [], []
    for r in reports:
        if r.name.startswith("sampler") and not r.error:
            total = r.peak_bytes + update.argument_bytes + r.code_bytes
            ok = total <= r.hbm_bytes
            lines.append(
                f"{r.name} + resident train state: {total / GiB:.2f} of {r.hbm_bytes / GiB:.2f} "
                f"GiB, {'fits' if ok else 'does NOT fit'}"
            )
            bad += [] if ok else [f"{r.name} (with the train state resident)"]
    return lines, bad


def paged_lines(meta: dict) -> list[str]:
    """The paged engine's layout and the step estimate, as the report's summary lines."""
    lines = []
    if p := meta.get("paged"):
        lines.append(
            f"paged KV: {p['pages_per_shard']} pages x {p['page_size']} tokens per data shard "
            f"({p['data_shards']} shards, {p['pool_gib_per_chip']:.1f} GiB per chip), "
            f"{p['concurrent_rows']} of {p['rows_per_call']} rows at once, attention "
            f"{p['attention']}"
        )
        if "decode_peak_gib_per_chip" in p:
            lines.append(
                f"sampler decode peak {p['decode_peak_gib_per_chip']:.1f} GiB per chip, "
                f"{p['decode_peak_with_train_state_gib_per_chip']:.1f} with the train state; "
                f"{p['headroom_gib_per_chip']:.1f} GiB of HBM left"
            )
    if e := meta.get("step_estimate"):
        lines.append(
            f"estimate: decode {e['decode_s_before']:.0f} s static, "
            f"{e['decode_s_slots_blocked']:.0f} s blocked slots, {e['decode_s_after']:.0f} s "
            f"paged (slowest / mean shard {e['paged']['slowest_over_mean_shard']:.2f}); "
            f"decode + update {e['step_s_decode_update']:.0f} s"
        )
        lines += step_rows(e)
    return lines


def step_rows(e: dict) -> list[str]:
    """The complete step's "at peak" and "expected" rows, term by term."""
    names = list(e["terms"]["at_peak"])
    row = lambda label, terms, total: (
        f"{label:<9}" + "  ".join(f"{n} {terms[n]:.1f}" for n in names) + f"  = step {total:.1f} s"
    )
    return [
        row("at peak", e["terms"]["at_peak"], e["step_s_after"]),
        row("expected", e["terms"]["expected"], e["step_s_expected"]),
        "(what each row assumes: step_estimate.assumptions)",
    ]


def write_json(path: str, reports: list[ProgramReport], **meta) -> None:
    with open(path, "w") as f:
        json.dump({**meta, "programs": [r.as_dict() for r in reports]}, f, indent=2)


def is_resource_exhausted(err: BaseException) -> bool:
    """True for the compiler's out-of-memory error (the program does not fit in HBM)."""
    return "RESOURCE_EXHAUSTED" in str(err) or "Ran out of memory" in str(err)


# ---------------------------------------------------------------- step-time estimate


@dataclasses.dataclass(frozen=True)
class Lengths:
    """The stated length distribution of the estimate: prompts, lognormal responses."""

    prompt_tokens: int = 300
    response_mean: float = 2500.0
    at_limit: float = 0.05  # share of responses that reach max_new_tokens
    sigma: float = 1.0
    seed: int = 0

    def scaled_to(self, limit: int, paper_limit: int = 8192) -> "Lengths":
        """The stated distribution for responses up to `limit`: above the paper's 8192, the
        mean stretched in proportion (a long-reasoning run writes longer), the rest kept."""
        if limit <= paper_limit:
            return self
        return dataclasses.replace(self, response_mean=self.response_mean * limit / paper_limit)

    def draw(self, rows: int, limit: int):
        """at_limit of the rows at `limit`, the rest lognormal below it; mean response_mean."""
        import numpy as np

        rng = np.random.default_rng(self.seed)
        lengths = np.full(rows, limit)
        rest = rng.random(rows) >= self.at_limit
        pool = rng.lognormal(0.0, self.sigma, 8 * rows + 1000)
        lo, hi = 1e-3, float(limit)
        for _ in range(60):  # bisect the scale; draws at or over the limit are redrawn
            scale = (lo + hi) / 2
            below = np.round(pool * scale)
            below = np.maximum(below[below < limit][: rest.sum()], 1)
            mean = (below.sum() + limit * (~rest).sum()) / rows
            lo, hi = (scale, hi) if mean < self.response_mean else (lo, scale)
        lengths[rest] = below
        return lengths.astype(int)


def _slot_schedule(lengths_DR, slots_per_shard: int, prompt_tokens: int, block: int):
    """Per decode step of the slot sampler: (blocks read per slot, whether a slot refilled).

    Each shard refills its slots from its own queue in row order; the attention's block loop
    runs to the longest valid prefix over all shards (one trip count for the SPMD program).
    """
    import numpy as np

    D, R = lengths_DR.shape
    S = slots_per_shard
    left = np.zeros((D, S), int)  # tokens still to decode in each slot
    done = np.zeros((D, S), int)  # tokens the slot's row has so far
    nxt = np.zeros(D, int)
    blocks, refills = [], []
    while True:
        free = left == 0
        take = np.minimum(free.sum(1), R - nxt)
        refilled = False
        for d in range(D):  # refill free slots in order
            idx = np.flatnonzero(free[d])[: take[d]]
            rows = lengths_DR[d, nxt[d] : nxt[d] + take[d]]
            left[d, idx], done[d, idx] = rows - 1, 1
            nxt[d] += take[d]
            refilled |= bool(take[d])
        live = left > 0
        if not live.any():
            break
        valid = np.where(live, prompt_tokens + done, 0).max()
        blocks.append(-(-valid // block))
        refills.append(refilled)
        left = np.where(live, left - 1, 0)
        done = done + live
    return np.array(blocks), np.array(refills)


@dataclasses.dataclass(frozen=True)
class PagedDecode:
    """Per decode step of the paged engine, per shard: live rows, KV tokens read, pages held."""

    live_SD: object  # [steps, shards] rows decoding
    read_SD: object  # [steps, shards] KV tokens the kernel reads (each row's, block-rounded)
    kv_SD: object  # [steps, shards] KV tokens attended (each row's exact length)
    pages_SD: object  # [steps, shards] pages held by live rows (prompt pages counted apart)


def _refill_in_order(left, done, lengths_DR, nxt):
    """Each shard's free slots take its own next rows, in row order."""
    import numpy as np

    for d in range(len(left)):
        idx = np.flatnonzero(left[d] == 0)[: lengths_DR.shape[1] - nxt[d]]
        left[d, idx], done[d, idx] = lengths_DR[d, nxt[d] : nxt[d] + len(idx)] - 1, 1
        nxt[d] += len(idx)


def _refill_balanced(left, done, lengths_DR, nxt, prompt_tokens):
    """One queue of every shard's rows in row order: each next row goes to a free slot of
    the shard with the fewest live KV tokens (the lowest such shard on ties)."""
    import numpy as np

    queue = lengths_DR.reshape(-1)
    free = left == 0
    load = np.where(free, 0, prompt_tokens + done).sum(1).astype(float)
    while nxt[0] < len(queue) and free.any():
        d = int(np.argmin(np.where(free.any(1), load, np.inf)))
        s = int(np.flatnonzero(free[d])[0])
        left[d, s], done[d, s], free[d, s] = queue[nxt[0]] - 1, 1, False
        load[d] += prompt_tokens + 1
        nxt[0] += 1


def _paged_schedule(
    lengths_DR, slots_per_shard, prompt_tokens, page_size, block_tokens, balance=False
):
    """The slot schedule (refill in row order, or `balance`d over the shards) with each row's
    own length instead of a block loop to the longest row: what the ragged paged kernel
    reads and the pages rows hold.

    A row of kv_len tokens reads ceil(kv_len / block_tokens) kernel blocks (the kernel copies
    whole blocks); it holds its own pages from its prompt's last partial page on (the
    prompt's full pages are shared by its samples and counted apart).
    """
    import numpy as np

    D, R = lengths_DR.shape
    left = np.zeros((D, slots_per_shard), int)
    done = np.zeros((D, slots_per_shard), int)
    nxt = np.zeros(D, int)
    shared = prompt_tokens // page_size
    out = {"live": [], "read": [], "kv": [], "pages": []}
    while True:
        if balance:
            _refill_balanced(left, done, lengths_DR, nxt, prompt_tokens)
        else:
            _refill_in_order(left, done, lengths_DR, nxt)
        live = left > 0
        if not live.any():
            break
        kv = np.where(live, prompt_tokens + done, 0)
        out["live"].append(live.sum(1))
        out["kv"].append(kv.sum(1))
        out["read"].append((-(-kv // block_tokens) * block_tokens).sum(1))
        out["pages"].append(np.where(live, -(-kv // page_size) - shared, 0).sum(1))
        left = np.where(live, left - 1, 0)
        done = done + live
    return PagedDecode(*(np.array(out[k]) for k in ("live", "read", "kv", "pages")))


@dataclasses.dataclass(frozen=True)
class DecodeCost:
    """Bytes and FLOPs of one decode step on one chip: weights once, then per row."""

    weight_bytes: float  # the shard's weights (sampler.param_dtype, split over tp), once a step
    kv_token_bytes: float  # one cached token's K and V over all layers, on this chip
    row_flops: float  # matmul FLOPs per decoded row (weights x 2), on this chip
    kv_token_flops: float  # attention FLOPs per cached token a row attends to, on this chip
    row_group: int = 1  # row shards whose rows each chip's matmuls run (tp with dp_attention)

    def seconds(self, spec, live, read, kv):
        """Per step: the slower of HBM traffic and compute (a roofline), arrays per shard."""
        import numpy as np

        if self.row_group > 1:  # the tp group's rows go through every chip's weight slice
            g = self.row_group
            live = np.repeat(live.reshape(*live.shape[:-1], -1, g).sum(-1), g, axis=-1)
        bytes_ = self.weight_bytes + read * self.kv_token_bytes
        flops = live * self.row_flops + kv * self.kv_token_flops
        return np.maximum(bytes_ / spec.hbm_bandwidth, flops / spec.peak_flops)


def decode_cost(
    mc, tp: int, dp_attention: bool = False, elem: ElementBytes = ElementBytes(2.0, 2.0),
    expert_shards: int = 1,
) -> DecodeCost:  # fmt: skip
    """The per-chip DecodeCost of model `mc` on a tensor-parallel group of `tp` chips; with
    dp_attention each chip attends every head of its own rows (a row shard per chip).
    `elem`: bytes per weight and per cached K or V value (step_terms.element_bytes).
    `expert_shards`: the experts split over that many data shards (sampler.expert_parallel),
    each chip reading its own shard's experts only.
    ValueError (naming sampler.mesh) for a tp that cannot split the heads: no such layout."""
    from ebpo_jax.sampler.layout import heads_split_error  # late: jax only when estimating

    if error := heads_split_error(mc.num_heads, mc.num_kv_heads, tp):
        raise ValueError(f"sampler.mesh: {error}")
    m = matmul_params(mc)
    heads_split = 1 if dp_attention else tp
    not_read = expert_params(mc) * (1 - 1 / expert_shards)  # the other shards' experts
    return DecodeCost(
        weight_bytes=elem.weight * (total_params(mc) - not_read) / tp,
        kv_token_bytes=elem.kv * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2 / heads_split,
        row_flops=2.0 * (m["layers"] + m["head"]) / tp,
        kv_token_flops=4.0 * mc.num_layers * mc.num_heads * mc.head_dim / heads_split,
        row_group=tp if dp_attention else 1,
    )


def collectives_per_step(
    mc, rows_per_data_shard: int, tp: int, dp_attention: bool, expert_shards: int = 1
) -> dict:
    """The decode step's collectives on one chip: tp's two ring all-reduces per layer of every
    computed row's activations and, with dp_attention, two all-to-alls per layer (q, k, v to
    the rows' chips; outputs back); bf16 bytes sent. With `expert_shards` > 1 (expert
    parallelism) each sparse layer adds expert_collectives."""
    L, H, K, Dh = mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim
    moved = rows_per_data_shard * (tp - 1) / tp**2 * (2 * H + 2 * K) * Dh * 2
    reduced = 2 * (tp - 1) / tp * rows_per_data_shard * mc.hidden_size * 2
    a2a = dp_attention and tp > 1
    return {
        "all_reduce": 2 * L if tp > 1 else 0,
        "all_to_all": 2 * L if a2a else 0,
        "all_to_all_bytes_sent_per_chip": float(L * moved) if a2a else 0.0,
        "all_reduce_bytes_sent_per_chip": float(2 * L * reduced) if tp > 1 else 0.0,
    } | expert_collectives(mc, rows_per_data_shard, expert_shards)


def expert_collectives(mc, rows_per_data_shard: int, expert_shards: int) -> dict:
    """Expert parallelism's collectives per decode step on one chip, over the `expert_shards`
    data shards (models/moe.py): per sparse layer a ring all-gather of the shard's rows (bf16
    activations, int32 expert ids, bf16 routing weights) and a ring reduce-scatter of the bf16
    outputs; each sends (shards - 1) x the shard's part. Empty with one shard."""
    if expert_shards <= 1:
        return {}
    Ls, D, k = mc.num_sparse_layers, mc.hidden_size, mc.num_experts_per_tok
    sent = (expert_shards - 1) * rows_per_data_shard
    return {
        "all_gather": Ls,
        "reduce_scatter": Ls,
        "all_gather_bytes_sent_per_chip": float(Ls * sent * (D * 2 + k * (4 + 2))),
        "reduce_scatter_bytes_sent_per_chip": float(Ls * sent * D * 2),
    }


def step_collectives(moves: dict) -> tuple[float, float]:
    """(bytes sent per chip, collectives) of one decode step's `collectives_per_step`."""
    sent = sum(v for key, v in moves.items() if key.endswith("_bytes_sent_per_chip"))
    count = sum(v for key, v in moves.items() if not key.endswith("_bytes_sent_per_chip"))
    return sent, count


class PagedPool(NamedTuple):
    """The paged engine's layout for the estimate: shards, pages and the kernel's block."""

    shards: int  # row shards: the sampler mesh's data shards (x tp with dp_attention)
    tp: int  # tensor-parallel chips per data shard
    prompt_tokens: int
    page_size: int
    kv_pages: int  # the pool over all shards (0: not checked)
    block_tokens: int  # KV tokens the kernel copies per block
    dp_attention: bool = False
    elem: ElementBytes = ElementBytes(2.0, 2.0)  # bytes per weight and per K or V value
    balance: bool = False  # refills go to the least-loaded shard (else each its own rows)
    expert_shards: int = 1  # the experts split over the data shards (expert parallelism)


def paged_decode_estimate(run_spec, mc, spec, rows_C, pool: PagedPool):
    """Seconds and page use of the paged engine over one sampler call's rows `rows_C`.

    The SPMD step waits for its slowest shard: per step the maximum over shards of the
    roofline time.
    """
    shards, tp, prompt_tokens, page_size, kv_pages = pool[:5]
    per_call = rows_C.size
    slots = min(run_spec.rollout.sampler.slots or per_call, per_call)
    sched = _paged_schedule(rows_C.reshape(shards, -1), slots // shards, prompt_tokens,
                            page_size, pool.block_tokens, pool.balance)  # fmt: skip
    cost = decode_cost(mc, tp, pool.dp_attention, pool.elem, pool.expert_shards)
    step_SD = cost.seconds(spec, sched.live_SD, sched.read_SD, sched.kv_SD)
    prompts = run_spec.rollout.prompts_per_call
    prompt_pages = prompts // shards * -(-prompt_tokens // page_size)
    peak = int(sched.pages_SD.max()) + prompt_pages
    bw_only = (cost.weight_bytes + sched.read_SD * cost.kv_token_bytes) / spec.hbm_bandwidth
    return {
        "decode_s": float(step_SD.max(1).sum()),
        "shard_mean_s": float(step_SD.mean(1).sum()),
        "decode_s_bandwidth_only": float(bw_only.max(1).sum()),
        "steps": len(step_SD),
        "concurrent_rows": slots,
        "peak_pages_per_shard": peak,
        "pool_pages_per_shard": kv_pages // shards,
        "pages_fit": bool(kv_pages == 0 or peak <= kv_pages // shards),
    }


ASSUMPTIONS = (
    (
        "decode per step and chip: the slower of HBM traffic (weights / tp once at "
        "sampler.param_dtype's bytes, plus the KV bytes read at sampler.kv_dtype's) and bf16 "
        "compute (2 x matmul params / tp per row, plus attention); the SPMD step waits for "
        "its slowest data shard"
    ),
    (
        "paged: each row reads only its own tokens, rounded up to the TPU kernel's KV block; "
        "rows refill their slot in row order; prompt pages are shared by a prompt's samples"
    ),
    (
        "dp_attention: a row shard per chip, each reading every kv head of its rows; the "
        "matmuls run the tp group's rows on each chip's weight slice"
    ),
    (
        "expert_parallel (paged only): each chip reads its data shard's E / shards experts; "
        "each sparse layer adds an all-gather of the shard's rows and a reduce-scatter of "
        "their outputs over the data shards; prefill gathers the experts instead (not priced); "
        "the weight move sends each chip its own shard's experts"
    ),
    "update: model FLOPs at bf16 peak (padded width before, each row's real tokens after)",
    (
        "step_s_after: the complete step at peak (terms.at_peak: decode, sampling, prefill, "
        "weight move, decode and update collectives, update, host reward); step_s_expected: "
        "terms.expected; step_s_decode_update: decode + update only (the old step_s_after)"
    ),
)


def _blocked_decode(rows_CDR, cost, spec, *, slots, width, prompt_len, block):
    """(seconds, steps) of today's slot sampler: each step reads every slot's cache blocks up
    to the longest live row; a refill copies a prompt cache (bandwidth only)."""
    total, steps = 0.0, 0
    for call in rows_CDR:
        blocks, refills = _slot_schedule(call, slots, width, block)
        kv = slots * block * blocks.sum() * cost.kv_token_bytes
        copies = 2 * refills.sum() * slots * prompt_len * cost.kv_token_bytes
        total += (len(blocks) * cost.weight_bytes + kv + copies) / spec.hbm_bandwidth
        steps += len(blocks)
    return total, steps


def _update_seconds(run_spec, mc, rows, prompt_tokens, devices, peak):
    """The packed update's model FLOPs over each row's real tokens, at bf16 peak."""
    m = matmul_params(mc)
    T_r = prompt_tokens + rows
    per_row = (
        2.0 * m["layers"] * T_r
        + 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * T_r**2 / 2
        + 2.0 * m["head"] * rows
    )
    ref = 1.0 if run_spec.update.loss.kl_coef > 0 else 0.0
    return float(run_spec.update.loss.ppo_epochs * (3.0 + ref) * per_row.sum()) / devices / peak


def kernel_block_tokens(page_size: int, pages_per_row: int, rows: int) -> int:
    """KV tokens per block of the TPU ragged paged kernel, as `kernels.ragged_paged_tpu` sets it."""
    from ebpo_jax.kernels.ragged_paged_tpu import block_sizes

    return block_sizes(page_size, pages_per_row, rows)[0] * page_size


def _paged_calls(run_spec, mc, spec, calls_CDR, pool: PagedPool):
    """Decode seconds of the paged engine over every call, and the first call's page use."""
    paged = [paged_decode_estimate(run_spec, mc, spec, c.reshape(-1), pool) for c in calls_CDR]
    total = lambda key: sum(c[key] for c in paged)
    meta = {
        "page_size": pool.page_size,
        "kernel_block_tokens": pool.block_tokens,
        "decode_s_bandwidth_only": total("decode_s_bandwidth_only"),
        "steps_all_calls": total("steps"),
        "slowest_over_mean_shard": total("decode_s") / total("shard_mean_s"),
        # Every step at its shards' mean: the floor of any balancing, moving live rows too.
        "decode_s_even_shards": total("shard_mean_s"),
    }
    return total("decode_s"), paged[0] | meta


class SamplerLayout(NamedTuple):
    """How the sampler mesh splits a call's rows: `shards` data shards of `tp` chips each;
    with `dp_attention` the paged engine's rows and pages are split over shards x tp; with
    `expert_parallel` its experts over the data shards."""

    shards: int
    tp: int = 1
    dp_attention: bool = False
    expert_parallel: bool = False

    @property
    def expert_shards(self) -> int:
        """Data shards the paged engine's experts split over (1: every chip reads them all)."""
        return self.shards if self.expert_parallel else 1


def step_time_estimate(
    run_spec, mc, spec, *, prompt_len, layout: SamplerLayout, lengths=None, block=256
):
    """Seconds per RL step (decode and update) for today's samplers and the paged engine, and
    the complete step (every step_terms term, at peak and expected) for the paged engine.

    before: the static sampler reading the whole cache every step, `prompts_per_call` calls,
    each to max_new_tokens, and the update at the padded width. slots_blocked: today's
    `sampler.slots` continuous batching with valid-prefix attention (blocks up to the
    longest live row). after: the paged engine (`sampler.slots` rows at once, pages of
    `sampler.page_size`, a pool of `sampler.kv_pages`) with the ragged kernel, and the packed
    update over the real tokens. ASSUMPTIONS (also in the output) say what is modelled.
    `layout.dp_attention` splits only the paged engine's rows over shards x tp (before and
    slots_blocked keep heads split over tp), `layout.expert_parallel` only its experts.
    """
    shards, tp, dp_attention = layout[:3]
    P, G, N = run_spec.rollout.prompts, run_spec.rollout.group_size, run_spec.rollout.max_new_tokens
    lengths = Lengths().scaled_to(N) if lengths is None else lengths
    elem = step_terms.element_bytes(run_spec.rollout.sampler, mc)
    cost = decode_cost(mc, tp, elem=elem)
    per_call = run_spec.rollout.prompts_per_call
    rows = lengths.draw(P * G, N)
    prompt_tokens = min(lengths.prompt_tokens, prompt_len)  # real prompts fit the width
    # Before: every call decodes N - 1 steps over its rows' whole caches.
    static = per_call * G // shards * (prompt_len + N) * cost.kv_token_bytes
    before = (P // per_call) * (N - 1) * (cost.weight_bytes + static) / spec.hbm_bandwidth
    slots = min(run_spec.rollout.sampler.slots or per_call * G, per_call * G)
    width = prompt_len if slots == per_call * G else prompt_tokens  # static: padded prompts
    calls_CDR = rows.reshape(P // per_call, shards, -1)
    blocked, steps = _blocked_decode(calls_CDR, cost, spec, slots=slots // shards, width=width,
                                     prompt_len=prompt_len, block=block)  # fmt: skip
    # The issue-29 "ideal": each row its own tokens, bandwidth only, shards averaged.
    own = (rows.sum() * prompt_tokens + 0.5 * (rows**2).sum()) * cost.kv_token_bytes / shards
    ideal = (steps * cost.weight_bytes + own) / spec.hbm_bandwidth
    inputs = _StepInputs(run_spec, mc, spec, layout, rows, prompt_tokens, prompt_len, elem)
    after, paged = _paged_after(inputs, calls_CDR, slots)
    devices, peak = shards * tp, spec.peak_flops
    update_after = _update_seconds(run_spec, mc, rows, prompt_tokens, devices, peak)
    terms = _complete_terms(inputs, after, update_after, paged)
    return {
        "lengths": dataclasses.asdict(lengths)
        | {"drawn_mean": float(rows.mean()), "drawn_at_limit": float((rows == N).mean())},
        "slots": slots,
        "decode_steps_slots": steps,
        "slot_utilisation": float((rows - 1).sum() / (steps * slots)),
        "decode_s_before": float(before),
        "decode_s_slots_blocked": float(blocked),
        "decode_s_ragged_ideal": float(ideal),
        "decode_s_after": float(after),
        "paged": paged,
        "update_s_before": update_flops(run_spec, mc, prompt_len) / devices / peak,
        "update_s_after_packed": update_after,
        "step_s_slots_blocked": float(blocked) + update_after,
        "step_s_decode_update": float(after) + update_after,
        "element_bytes": elem._asdict(),
        **_totals(terms),
        "assumptions": [*ASSUMPTIONS, *step_terms.assumptions(spec)],
    }


def _paged_after(x: "_StepInputs", calls_CDR, slots: int):
    """The paged engine's decode seconds over every call and its report fields: page use,
    the decode step's collectives, the same decode with balanced admission."""
    ro, (shards, tp, dp) = x.run_spec.rollout, x.layout[:3]
    page_size = int(ro.sampler.page_size or 16)
    pages_per_row = -(-(x.prompt_len + ro.max_new_tokens) // page_size)
    block = kernel_block_tokens(page_size, pages_per_row, slots)
    pool = PagedPool(shards * tp if dp else shards, tp, x.prompt_tokens, page_size,
                     int(ro.sampler.kv_pages), block, dp, x.elem,
                     expert_shards=x.layout.expert_shards)  # fmt: skip
    after, paged = _paged_calls(x.run_spec, x.mc, x.chip, calls_CDR, pool)
    rows_per_shard = ro.prompts_per_call * ro.group_size // shards
    paged["collectives_per_step"] = collectives_per_step(
        x.mc, rows_per_shard, tp, dp, x.layout.expert_shards
    )
    paged["balanced_admission"] = _balanced(x.run_spec, x.mc, x.chip, calls_CDR, pool, slots)
    return after, paged


def _balanced(run_spec, mc, spec, calls_CDR, pool: PagedPool, slots: int):
    """The paged decode with refills balanced over the shards (None with a slot per row:
    every row is admitted at once, so there is no refill to place)."""
    if slots >= calls_CDR[0].size:
        return None
    seconds, meta = _paged_calls(run_spec, mc, spec, calls_CDR, pool._replace(balance=True))
    return {"decode_s": seconds, "slowest_over_mean_shard": meta["slowest_over_mean_shard"]}


def _totals(terms: dict) -> dict:
    """The complete step at peak and expected, beside the terms they add."""
    return {
        "terms": terms,
        "step_s_after": sum(terms["at_peak"].values()),
        "step_s_expected": sum(terms["expected"].values()),
    }


class _StepInputs(NamedTuple):
    """What the complete step's terms read: the run, the model, the chip and the draw."""

    run_spec: object
    mc: object
    chip: ChipSpec
    layout: "SamplerLayout"
    rows: object  # every response's length, drawn
    prompt_tokens: int
    prompt_len: int  # the padded prompt width
    elem: ElementBytes


def _complete_terms(x: _StepInputs, decode_s: float, update_s: float, paged: dict) -> dict:
    """Every term of the step (step_terms.Priced), priced at peak and expected."""
    ro, up, mc, chip = x.run_spec.rollout, x.run_spec.update, x.mc, x.chip
    shards, tp = x.layout[:2]
    devices, steps = shards * tp, paged["steps_all_calls"]
    slots = min(ro.sampler.slots or ro.prompts_per_call * ro.group_size,
                ro.prompts_per_call * ro.group_size) // shards  # fmt: skip
    moves = collectives_per_step(mc, slots, tp, x.layout.dp_attention, x.layout.expert_shards)
    sent, count = step_collectives(moves)
    mesh = dict(zip(x.run_spec.mesh.mesh.axes, x.run_spec.mesh.shape))
    micro = step_terms.packed_micro_batches(up, x.rows, x.prompt_tokens, x.prompt_len)
    fsdp = step_terms.update_collective_bytes(
        total_params(mc), mesh, micro, gathers=2 + x.run_spec.with_ref
    )
    move = step_terms.weight_move_bytes(step_terms.WeightMove(
        total_params(mc), step_terms.dtype_bytes(mc.param_dtype), x.elem, devices, tp,
        ro.sampler.param_dtype == "int8", bool(x.run_spec.mesh.sampler),
        int(expert_params(mc) * (1 - 1 / x.layout.expert_shards)),
    ))  # fmt: skip
    P = step_terms.Priced
    terms = {
        "decode": P(roofline_s=decode_s),
        "sampling": P(hbm_bytes=steps * slots * step_terms.sampling_bytes_per_row(
            mc.vocab_size, ro.sampler, tp)),
        "prefill": P(flops=step_terms.prefill_flops(matmul_params(mc), mc, ro.prompts,
                                                    x.prompt_len) / devices, mfu="prefill_mfu"),
        "weight_move": P(hbm_bytes=move["hbm_bytes_per_chip"],
                         ici_bytes=move["ici_bytes_per_chip"]),
        "decode_collectives": P(ici_bytes=steps * sent, collectives=steps * count),
        "update": P(flops=update_s * chip.peak_flops, mfu="update_mfu"),
        "update_collectives": P(ici_bytes=fsdp["bytes_sent_per_chip"],
                                collectives=fsdp["count"], in_update_mfu=True),
        "reward": P(seconds=step_terms.reward_seconds(
            ro.prompts * ro.group_size, x.run_spec.task.data.reward_workers,
            _scoring_hosts(ro.prompts, devices, chip))),
    }  # fmt: skip
    return step_terms.priced_terms(terms, chip)


def _scoring_hosts(prompts: int, devices: int, chip) -> int:
    """Hosts that share the host reward: the sampler's, when the prompts split over them."""
    hosts = max(1, devices // chip.chips_per_host)
    return hosts if prompts % hosts == 0 else 1


def exact_on_policy_terms(estimate: dict, run_spec, mc, *, prompt_len, devices, peak) -> dict:
    """`estimate` with what model.batch_invariant saves: the recompute forward at bf16 peak
    (`recompute_s`), and the step with the mode off and the recompute on (as TIS / MIS need)
    vs the mode on (the sampler's log-probs are the old ones). The mode's own numerics are
    not modelled: benchmarks/on_policy_bench.py measures their cost."""
    recompute = recompute_flops(run_spec, mc, prompt_len) / devices / peak
    step = estimate["step_s_after"]
    loss = run_spec.update.loss
    forwards = loss.ppo_epochs * (3.0 + (loss.kl_coef > 0))  # the update: fwd, bwd = 2 fwd, ref
    terms = {
        "recompute_s": recompute,
        # Today's recompute runs padded; packed, it would cost one of the update's forwards.
        "recompute_s_if_packed": estimate["update_s_after_packed"] / forwards,
        "step_s_mode_off_recompute": step + recompute,
        "step_s_mode_on": step,
        "saved_frac": recompute / (step + recompute),
    }
    return estimate | {"exact_on_policy": terms}


def exact_on_policy_lines(meta: dict) -> list[str]:
    """The summary line of exact_on_policy_terms, if the estimate has them."""
    e = meta.get("step_estimate", {}).get("exact_on_policy")
    if not e:
        return []
    return [
        f"exactly on-policy (model.batch_invariant): no recompute forward saves "
        f"{e['recompute_s']:.1f} s (padded; {e['recompute_s_if_packed']:.1f} s if packed), step "
        f"{e['step_s_mode_off_recompute']:.0f} s -> {e['step_s_mode_on']:.0f} s "
        f"({e['saved_frac']:.1%}; the mode's numerics not counted)"
    ]


# DAPO's refill rounds, the stated default of tokens generated per kept token: with pass
# rates uniform on [0, 1] a group of G is all-equal with probability 2 / (G + 1) (40% at
# G=4, 6% at G=32), so a second round of P prompts fills the step and the rollout decodes
# two rounds for one kept round (dropped groups as long as kept ones). A measured
# `dapo/generated_per_kept` from a run's metrics replaces it (aot_compile --generated_per_kept).
DAPO_GENERATED_PER_KEPT = 2.0


# The terms a DAPO refill round repeats: the update trains one round's P groups, once.
PER_ROUND = ("decode", "sampling", "prefill", "decode_collectives", "reward")


def with_refill(estimate: dict, generated_per_kept: float) -> dict:
    """`estimate` with DAPO's refill rounds: the rollout's terms (PER_ROUND) x tokens generated
    per kept token (rounds run one after another); the update still trains one round."""
    keys = ("decode_s_after", "step_s_after", "step_s_decode_update")
    one_round = {k: estimate[k] for k in keys if k in estimate}
    decode = estimate["decode_s_after"] * generated_per_kept
    scale = lambda row: {k: v * (generated_per_kept if k in PER_ROUND else 1.0)
                         for k, v in row.items()}  # fmt: skip
    terms = {row: scale(t) for row, t in estimate.get("terms", {}).items()}
    out = estimate | {
        "refill": {"generated_per_kept": generated_per_kept, "one_round": one_round},
        "decode_s_after": decode,
        "step_s_decode_update": decode + estimate["update_s_after_packed"],
        "assumptions": [
            *estimate["assumptions"],
            f"DAPO refill: decode, sampling, prefill, decode collectives and the host reward "
            f"x {generated_per_kept:g} tokens generated per kept token (a stated input)",
        ],
    }
    return out | (_totals(terms) if terms else {"step_s_after": out["step_s_decode_update"]})
