"""The step estimate's terms beside decode and the update, and the efficiencies of its
"expected" row.

Terms (seconds per RL step): prefill, sampling (logits and top-k/p), the trainer-to-sampler
weight move (cast or int8 quantize, then reshard), the collectives over ICI (per decode step
and in the update) and the host reward. "At peak" prices each at the chip's sheet numbers
(`hardware.ChipSpec`); "expected" divides each by a stated efficiency (`Efficiency`, with its
source) and adds a latency per collective.
"""

import math
from typing import NamedTuple

import numpy as np


class Efficiency(NamedTuple):
    """What the "expected" row assumes of the hardware, each a stated input with its source."""

    # MaxText's published MFU for Llama-3.1-8B (docs/reference/models/tiering.md: 45.46% on
    # v6e-256, bf16, sequence 8192; it lists no v5p figure). It is end to end, so the FSDP
    # collectives are inside it.
    update_mfu: float = 0.4546
    # Prefill is the same forward matmuls at a long width: taken at the update's MFU.
    prefill_mfu: float = 0.4546
    # Achieved over peak HBM bandwidth in decode ("model bandwidth utilisation"): about 60% for
    # tuned serving stacks (Databricks, "LLM Inference Performance Engineering: Best
    # Practices", 2023); also applied to sampling and the weight move's HBM passes.
    decode_bandwidth: float = 0.6
    # A collective along one mesh axis runs a bidirectional ring: 2 of a chip's links, of
    # 2 x torus_dims (v5p: 6) on a TPU torus; 0 = that fraction of the chip's ICI.
    ici: float = 0.0
    # Per collective, the fixed cost of a small ICI collective (docs/pods.md's assumption).
    collective_latency_s: float = 10e-6


EFFICIENCY = Efficiency()
# Host reward per response, one CPU core: rewards.math_reward took 54 ms a response on the
# shared, loaded 2-core build host (a 1800-word response ending in \boxed{}, five answer
# forms); a pod host's cores are faster, so this is an upper figure. Workers run in parallel.
REWARD_S_PER_RESPONSE = 0.05
DEFAULT_REWARD_WORKERS = 4  # data.reward_workers = 0: min(4, cpu count)
# Passes over a row's float32 logits per decode step: write, log-softmax (max, sum, write),
# the categorical draw; top-k / top-p add a sort of ~log2(V) read-write passes.
LOGIT_PASSES = 5


class ElementBytes(NamedTuple):
    """Bytes per element the sampler reads: a weight, and a cached K or V value."""

    weight: float
    kv: float


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name (or numpy / JAX dtype)."""
    return _ITEMSIZE[str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype]


def element_bytes(sampler, mc) -> ElementBytes:
    """sampler.param_dtype ("" = the trainer's params) and sampler.kv_dtype ("" = the model's
    compute dtype) as bytes per element; int8 adds its float32 scales: one per output channel
    of a weight (over hidden_size inputs), and the cache's as the pool stores them
    (kernels/quant.py)."""
    from ebpo_jax.kernels import quant  # late: the pool's own layout, one formula

    weight = dtype_bytes(sampler.param_dtype or mc.param_dtype)
    if sampler.param_dtype == "int8":
        weight += 4 / mc.hidden_size
    kv = quant.bytes_per_element(sampler.kv_dtype, mc.dtype, mc.head_dim)
    return ElementBytes(float(weight), float(kv))


def ici_efficiency(chip, eff: Efficiency = EFFICIENCY) -> float:
    """eff.ici, or a ring's 2 links of the torus's 2 x torus_dims."""
    return eff.ici or 1.0 / chip.torus_dims


def sampling_bytes_per_row(vocab: int, sampling, tp: int) -> float:
    """HBM bytes per computed row per decode step on one chip: its logits' passes, the
    vocabulary split over tp."""
    passes = LOGIT_PASSES
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        passes += 2 * math.ceil(math.log2(vocab))
    return passes * vocab * 4 / tp


def prefill_flops(matmuls: dict, mc, prompts: int, prompt_len: int) -> float:
    """Model FLOPs of prefilling `prompts` prompts at the padded width (the program's shape),
    logits at each prompt's last token only."""
    attn = 4.0 * mc.num_layers * mc.num_heads * mc.head_dim * prompt_len**2 / 2
    return prompts * (2.0 * matmuls["layers"] * prompt_len + attn + 2.0 * matmuls["head"])


class WeightMove(NamedTuple):
    """The trainer-to-sampler move of `params` weights."""

    params: int
    src_bytes: float  # the trainer's bytes per weight
    dst: ElementBytes  # the sampler's
    devices: int  # the trainer's chips (the cast runs on its layout)
    tp: int  # the sampler's weight split
    quantize: bool  # int8: an absmax pass, then a scale-and-round pass
    moved: bool  # the sampler has its own mesh (a reshard), else its weights are the trainer's
    not_received: int = 0  # weights no sampler chip holds a slice of (others' experts, EP)


def weight_move_bytes(move: WeightMove) -> dict:
    """Per chip: HBM bytes of the cast or quantize on the trainer's layout, ICI bytes of the
    reshard (each chip receives its sampler slice)."""
    local = move.params / move.devices
    cast = move.dst.weight != move.src_bytes
    reads = (2 if move.quantize else 1) * move.src_bytes if cast else 0.0
    hbm = local * (reads + (move.dst.weight if cast else 0.0))
    ici = (move.params - move.not_received) / move.tp * move.dst.weight if move.moved else 0.0
    return {"hbm_bytes_per_chip": hbm, "ici_bytes_per_chip": ici}


def update_collective_bytes(params: int, mesh: dict, micro_batches: int, gathers: int) -> dict:
    """Per RL step and chip: FSDP's weight all-gathers (bf16, `gathers` per micro-batch: the
    forward, the backward, the reference) and its float32 gradient reduce-scatter per
    micro-batch; a data axis all-reduces the gradient shards once per micro-batch too."""
    f, d = mesh.get("fsdp", 1), mesh.get("data", 1)
    gather = (f - 1) / f * params * 2 if f > 1 else 0.0
    scatter = (f - 1) / f * params * 4 if f > 1 else 0.0
    reduce = 2 * (d - 1) / d * params * 4 / f if d > 1 else 0.0
    per_micro = gathers * gather + scatter + reduce
    count = (gathers + 1) * (f > 1) + (d > 1)
    return {"count": micro_batches * count, "bytes_sent_per_chip": micro_batches * per_micro}


def packed_micro_batches(update, rows, prompt_tokens: int, prompt_len: int) -> int:
    """Micro-batches per RL step of the packed update: each mini-batch's real tokens over a
    micro-batch's budget (loss.tokens_per_microbatch, else the padded micro-batch's tokens)."""
    loss = update.loss
    per_mini = (np.asarray(rows) + prompt_tokens).sum() / loss.num_minibatches
    padded_rows = update.prompts * update.group_size // loss.num_minibatches
    budget = loss.tokens_per_microbatch or (
        padded_rows // loss.num_microbatches * (prompt_len + update.max_new_tokens)
    )
    return int(loss.ppo_epochs * loss.num_minibatches * math.ceil(per_mini / budget))


def reward_seconds(responses: int, workers: int, hosts: int = 1) -> float:
    """The host reward of one step's responses at REWARD_S_PER_RESPONSE, over `workers` on
    each of `hosts` (each scores its block of the prompts: distributed.map_row_blocks)."""
    return responses / hosts * REWARD_S_PER_RESPONSE / (workers or DEFAULT_REWARD_WORKERS)


class Priced(NamedTuple):
    """One term before pricing: FLOPs, HBM bytes and ICI bytes per chip, and collectives."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    ici_bytes: float = 0.0
    collectives: float = 0.0
    seconds: float = 0.0  # already in seconds, the same in both rows (the host reward)
    roofline_s: float = 0.0  # decode's roofline seconds: at decode_bandwidth in "expected"
    mfu: str = ""  # which Efficiency MFU divides its FLOPs in "expected"
    in_update_mfu: bool = False  # "expected" counts it inside the update's MFU: 0 here


def price(term: Priced, chip, eff: Efficiency = EFFICIENCY) -> tuple[float, float]:
    """(at peak, expected) seconds of one term on `chip`."""
    ici = chip.ici_bandwidth or float("inf")
    peak = term.flops / chip.peak_flops + term.hbm_bytes / chip.hbm_bandwidth + term.ici_bytes / ici
    peak += term.roofline_s + term.seconds
    if term.in_update_mfu:
        return peak, 0.0
    expected = (
        (term.flops / chip.peak_flops / getattr(eff, term.mfu) if term.flops else 0.0)
        + term.hbm_bytes / chip.hbm_bandwidth / eff.decode_bandwidth
        + term.ici_bytes / ici / ici_efficiency(chip, eff)
        + term.collectives * eff.collective_latency_s
        + term.roofline_s / eff.decode_bandwidth
    )
    return peak, expected + term.seconds


def priced_terms(terms: dict, chip, eff: Efficiency = EFFICIENCY) -> dict:
    """{"at_peak": {name: s}, "expected": {name: s}} of `terms` ({name: Priced})."""
    both = {name: price(t, chip, eff) for name, t in terms.items()}
    return {
        "at_peak": {name: float(p) for name, (p, _) in both.items()},
        "expected": {name: float(e) for name, (_, e) in both.items()},
    }


def assumptions(chip, eff: Efficiency = EFFICIENCY) -> list[str]:
    """What the two rows assume, for the report."""
    return [
        "at peak: every term at the chip's sheet numbers (bf16 FLOP/s, HBM bandwidth, ICI "
        f"{chip.ici_bandwidth / 1e9:.0f} GB/s sent per chip), terms added (no overlap), no "
        "collective latency",
        f"expected: update at {eff.update_mfu:.1%} MFU (MaxText's published Llama-3.1-8B, "
        "FSDP collectives inside it), prefill at "
        f"{eff.prefill_mfu:.1%}, decode, sampling and HBM passes at {eff.decode_bandwidth:.0%} "
        f"of HBM bandwidth, ICI at {ici_efficiency(chip, eff):.0%} (a ring's 2 links of the "
        f"torus), {eff.collective_latency_s * 1e6:.0f} us per collective",
        "prefill: every prompt at the padded width; sampling: every computed row's float32 "
        f"logits, {LOGIT_PASSES} passes (+ a sort with top-k / top-p), vocabulary split over tp",
        "weight move: cast or int8 quantize on the trainer's layout, then each chip receives "
        "its sampler slice over ICI",
        f"host reward: {REWARD_S_PER_RESPONSE * 1e3:.0f} ms per response on each of "
        "data.reward_workers (0 = 4) processes per host, each host scoring its block of the "
        "prompts (the sampler's chips / chips_per_host hosts)",
    ]
