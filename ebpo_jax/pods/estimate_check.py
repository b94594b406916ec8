"""Measured phase times beside `aot_report.step_time_estimate`'s for the same config and chip.

A run's metrics.jsonl carries per-step phase times (`phase/<name>_s`, watchdog.PhaseTimer);
the estimate models decode and the update from the model's bytes and FLOPs on a `ChipSpec`.
On a TPU or GPU the chip is the named one (`aot_report.CHIPS`, `gpu_topology`); on a CPU it
is this CPU's own peak, measured here by two microbenchmarks (`measure_cpu`): a float32
matmul for FLOP/s and the sum of a 256 MiB array for bytes read/s, best of a few runs each.
"""

import dataclasses
import os
import time

import numpy as np

from ebpo_jax.pods.aot_report import Lengths, SamplerLayout, step_time_estimate
from ebpo_jax.pods.hardware import ChipSpec

# The estimate's terms beside the phase each one predicts (the static sampler unless slots).
_TERMS = (
    ("rollout", ("decode_s_before", "decode_s_slots_blocked", "decode_s_after")),
    ("update", ("update_s_before", "update_s_after_packed")),
)
_UNMODELLED = ("weight_move", "reward", "checkpoint", "rollout_update", "scan_step")


def _best_of(fn, repeats: int) -> float:
    fn()  # compile, fault in pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_cpu(n: int = 1024, read_mib: int = 256, repeats: int = 5) -> ChipSpec:
    """This CPU as a ChipSpec: float32 matmul FLOP/s and bytes read/s, measured now."""
    import jax
    import jax.numpy as jnp

    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    matmul = jax.jit(lambda x: x @ x)
    flops = 2.0 * n**3 / _best_of(lambda: matmul(a).block_until_ready(), repeats)
    x = jax.device_put(jnp.ones((read_mib << 18,), jnp.float32), cpu)
    read = jax.jit(jnp.sum)  # decode reads weights and cache: a read, not a copy's page faults
    bandwidth = x.nbytes / _best_of(lambda: read(x).block_until_ready(), repeats)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ChipSpec("cpu", memory, flops, bandwidth, 1, 1, chips_per_host=len(jax.devices()))


def device_chip(device) -> ChipSpec:
    """The ChipSpec of `device`: a known TPU or GPU from its kind, else this CPU, measured."""
    from ebpo_jax.pods.aot_report import CHIPS
    from ebpo_jax.pods.gpu_topology import GPUS

    kind = device.device_kind.lower()
    for name, gpu in GPUS.items():
        if name.lower() in kind:
            return gpu.chip()
    for name, chip in CHIPS.items():
        if name in kind.replace(" ", "").replace("tpu", ""):
            return chip
    if device.platform != "cpu":
        raise ValueError(f"no peak numbers for device kind {device.device_kind!r}")
    return measure_cpu()


def measured_phases(rows: list[dict]) -> dict[str, float]:
    """Median seconds per phase (and the whole step) over the rows after the compiled first."""
    timed = [r for r in rows if r.get("step", 0) >= 2 and "perf/step_time_s" in r]
    keys = sorted({k for r in timed for k in r if k.startswith("phase/")} | {"perf/step_time_s"})
    out = {}
    for k in keys:
        values = [r[k] for r in timed if r.get(k) is not None]
        if values:
            name = "step" if k == "perf/step_time_s" else k[len("phase/") : -len("_s")]
            out[name] = float(np.median(values))
    return out


def measured_lengths(rows: list[dict], prompt_tokens: int) -> Lengths:
    """The estimate's length distribution as the run drew it (mean, share at the limit)."""
    timed = [r for r in rows if "response_length/mean" in r]
    mean = float(np.mean([r["response_length/mean"] for r in timed]))
    at_limit = float(np.mean([r["response_length/truncated_frac"] for r in timed]))
    return Lengths(prompt_tokens=prompt_tokens, response_mean=mean, at_limit=at_limit)


def estimate(spec, mc, chip: ChipSpec, prompt_len: int, lengths: Lengths) -> dict:
    """step_time_estimate on one data shard and no tp (the run's own mesh: one device)."""
    one = SamplerLayout(shards=1, tp=1)
    return step_time_estimate(spec, mc, chip, prompt_len=prompt_len, layout=one, lengths=lengths)


def _used(spec) -> dict[str, str]:
    """Which estimate term is this config's own: the static or slot sampler, padded update."""
    sampler = spec.rollout.sampler
    decode = "decode_s_before" if not sampler.slots else "decode_s_after"
    packed = spec.update.loss.tokens_per_microbatch
    update = "update_s_after_packed" if packed else "update_s_before"
    return {"rollout": decode, "update": update}


def report(measured: dict[str, float], est: dict, spec, chip: ChipSpec) -> str:
    """The table: each phase's measured median beside the estimate's terms for it."""
    used = _used(spec)
    how = (
        ("float32 matmul", "read", ", measured now")
        if chip.generation == "cpu"
        else ("bf16 peak", "HBM", " (the chip's sheet)")
    )
    lines = [
        f"chip: {chip.generation}: {chip.peak_flops / 1e9:.1f} GFLOP/s ({how[0]}), "
        f"{chip.hbm_bandwidth / 1e9:.1f} GB/s ({how[1]}){how[2]}",
        f"{'phase':<16}{'measured s':>12}  estimate (s; * = this config's sampler / update)",
    ]
    for phase, terms in _TERMS:
        shown = "  ".join(f"{t}{'*' if used.get(phase) == t else ''} {est[t]:.3g}" for t in terms)
        lines.append(f"{phase:<16}{measured.get(phase, float('nan')):>12.4f}  {shown}")
    for phase in _UNMODELLED:
        if phase in measured:
            lines.append(f"{phase:<16}{measured[phase]:>12.4f}  not modelled")
    est_step = est[used["rollout"]] + est[used["update"]]
    lines.append(f"{'step':<16}{measured.get('step', float('nan')):>12.4f}  {est_step:.3g}")
    ratio = measured.get("step", float("nan")) / est_step if est_step else float("nan")
    lines.append(f"measured / estimated step: {ratio:.3g}")
    lines.append("estimate assumes: " + "; ".join(est["assumptions"]))
    return "\n".join(lines)


def as_json(measured: dict, est: dict, chip: ChipSpec) -> dict:
    """The report's numbers, for a file."""
    keep = {k: v for k, v in est.items() if isinstance(v, int | float)}
    return {"chip": dataclasses.asdict(chip), "measured_s": measured, "estimate_s": keep}
