"""GPU smoke check, a few minutes on one GPU: python experiments/gpu_check.py [--quick].

Prints one line per check (OK / FAIL / SKIP) and exits 1 if any check fails:
  1. the micro config end to end (configs/micro.py through the trainer's `train`), attention auto;
  2. HF parity: logits of tiny random Llama-3 / Qwen3 checkpoints vs transformers (torch CPU);
  3. sampler == forward: `generate`'s log-probs equal the log-softmax of `forward`;
  4. one update (grads + AdamW step) with cuDNN attention against the XLA attention;
  5. throughput: decode tokens/s and update tokens/s on a 0.6B Qwen3 in bf16, MFU against
     the card's bf16 peak (ebpo_jax.pods.gpu_topology) and decode against HBM bandwidth.
On a CPU the GPU-specific checks (4, 5) print SKIP; the others run as on a GPU.
"""

import argparse
import importlib.util
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = []


def report(name, status, detail=""):
    RESULTS.append(status)
    print(f"{status:4s}  {name}: {detail}", flush=True)


def check(name):
    """Runs the decorated check now; an exception is a FAIL line, not a crash."""

    def run(fn):
        t0 = time.perf_counter()
        try:
            status, detail = fn()
        except Exception as e:  # noqa: BLE001 (a smoke check reports every failure, goes on)
            status, detail = "FAIL", f"{type(e).__name__}: {str(e)[:300]}"
        report(name, status, f"{detail} ({time.perf_counter() - t0:.0f} s)")
        return fn

    return run


def on_gpu():
    import jax

    return jax.default_backend() == "gpu"


def card():
    """The GpuModel of device 0 (H100 / H200), or None."""
    import jax

    from ebpo_jax.pods import gpu_topology

    kind = jax.devices()[0].device_kind.lower()
    return next((g for n, g in gpu_topology.GPUS.items() if n in kind), None)


def micro_end_to_end():
    from ebpo_jax.trainer.loop import train

    spec = importlib.util.spec_from_file_location("micro", os.path.join(ROOT, "configs/micro.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    with tempfile.TemporaryDirectory() as workdir, config.unlocked():
        config.workdir = workdir
        config.model.overrides.attention = "auto"
        s = train(config, log=lambda *a, **k: None)
    detail = f"pass@1 {100 * s['pass@1_start']:.1f}% -> {100 * s['pass@1_end']:.1f}%"
    return "OK", f"{detail} after {s['step']} steps, attention auto"


def hf_parity():
    import jax
    import numpy as np

    try:
        import torch
        import transformers
    except ImportError as e:
        return "SKIP", f"needs torch and transformers ({e})"
    from ebpo_jax import models

    common = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    hf_configs = {
        "llama": (transformers.LlamaConfig(**common, head_dim=16), transformers.LlamaForCausalLM),
        "qwen3": (
            transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True),
            transformers.Qwen3ForCausalLM,
        ),
    }
    tokens = np.random.default_rng(0).integers(0, 128, (2, 40))
    errs = []
    for kind, (hf_config, cls) in hf_configs.items():
        torch.manual_seed(0)
        model = cls(hf_config).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.15)
            ref = model(torch.as_tensor(tokens)).logits.float().numpy()
        with tempfile.TemporaryDirectory() as path:
            model.save_pretrained(path)
            config, params = models.from_hf(path, dtype="float32")
        with jax.default_matmul_precision("highest"):  # GPUs default to TF32 for f32 matmuls
            logits = np.asarray(jax.jit(models.forward, static_argnums=0)(config, params, tokens))
        errs.append(f"{kind} {np.abs(logits - ref).max():.1e}")
        if np.abs(logits - ref).max() > 1e-4:
            return "FAIL", f"max |logit diff| {', '.join(errs)} (limit 1e-4)"
    return "OK", f"max |logit diff| vs transformers: {', '.join(errs)}"


def sampler_equals_forward():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ebpo_jax import models, sampler

    config = models.get_config("tiny_qwen3")
    params = models.init_params(config, jax.random.key(0))
    prompts = np.array([[5, 6, 7, 8], [9, 10, 77, 77]], np.int32)
    lengths = np.array([4, 2], np.int32)
    N, G = 8, 2
    spec = sampler.SamplerSpec(max_new_tokens=N, num_samples=G)
    gen = sampler.generate(config, params, prompts, lengths, spec, rng=jax.random.key(1))
    worst = 0.0
    for r in range(2 * G):
        p = r // G
        seq = np.concatenate([prompts[p, : lengths[p]], np.asarray(gen.tokens[r])])[None]
        with jax.default_matmul_precision("highest"):
            logp = jax.nn.log_softmax(models.forward(config, params, jnp.asarray(seq))[0], -1)
        idx = lengths[p] - 1 + np.arange(N)
        ref = np.asarray(logp)[idx, np.asarray(gen.tokens[r])]
        worst = max(worst, float(np.abs(ref - np.asarray(gen.logprobs[r])).max()))
    status = "OK" if worst < 1e-3 else "FAIL"
    return status, f"max |sampler - forward| log-prob {worst:.1e} over {2 * G} rows x {N} tokens"


def _update_fn(config, P, G, Tp, N):
    """(params, batch) -> (loss, new params): grouped forward, token log-prob loss, one AdamW step."""
    import jax
    import jax.numpy as jnp
    import optax

    from ebpo_jax import losses, models

    opt = optax.adamw(1e-4)

    def loss_fn(params, prompt, plen, comp, clen):
        _, h_BND = models.forward_grouped(
            config, params, models.GroupedRows(prompt, plen, comp, clen), return_hidden=True
        )
        w_DV = models.output_embedding(config, params)
        logp = losses.logprobs_from_hidden(h_BND, w_DV, comp, chunk_size=min(N, 512))
        valid = jnp.arange(N)[None] < clen[:, None]
        return -jnp.sum(jnp.where(valid, logp, 0.0)) / valid.sum()

    def update(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        updates, _ = opt.update(grads, opt.init(params), params)
        return loss, optax.apply_updates(params, updates), grads

    return jax.jit(update)


def _batch(config, P, G, Tp, N, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return (
        rng.integers(1, config.vocab_size, (P, Tp), dtype=np.int32),
        rng.integers(Tp // 4, Tp + 1, (P,), dtype=np.int32),
        rng.integers(1, config.vocab_size, (P * G, N), dtype=np.int32),
        rng.integers(N // 4, N + 1, (P * G,), dtype=np.int32),
    )


def cudnn_update_vs_xla():
    if not on_gpu():
        return (
            "SKIP",
            "needs a GPU (the cuDNN code path is checked on CPU by tests/attention_test.py)",
        )
    import jax
    import numpy as np

    from ebpo_jax import models

    config = models.get_config("qwen3_0_6b", num_layers=4, dtype="bfloat16", param_dtype="float32")
    P, G, Tp, N = 4, 4, 512, 1024
    params = models.init_params(config, jax.random.key(0))
    batch = _batch(config, P, G, Tp, N)
    out = {}
    for attn in ("cudnn", "xla"):
        c = config.replace(attention=attn)
        loss, new, grads = _update_fn(c, P, G, Tp, N)(params, batch)
        out[attn] = (float(loss), new, grads)
        text = jax.jit(_update_fn(c, P, G, Tp, N)).lower(params, batch).as_text()
        if (attn == "cudnn") != ("cudnn" in text):
            return "FAIL", f"attention {attn!r}: cuDNN custom call present = {'cudnn' in text}"
    (l1, p1, g1), (l2, p2, g2) = out["cudnn"], out["xla"]
    flat = lambda t: np.concatenate([np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(t)])
    g_rel = np.linalg.norm(flat(g1) - flat(g2)) / np.linalg.norm(flat(g2))
    d1, d2 = flat(p1) - flat(params), flat(p2) - flat(params)
    cos = float(d1 @ d2 / (np.linalg.norm(d1) * np.linalg.norm(d2)))
    status = "OK" if abs(l1 - l2) < 1e-2 * abs(l2) and g_rel < 5e-2 else "FAIL"
    return status, (
        f"loss {l1:.5f} vs {l2:.5f}; |grad diff|/|grad| {g_rel:.1e}; update cosine {cos:.4f} "
        f"(bf16, qwen3_0_6b x 4 layers, {P}x{G} rows of {Tp}+{N})"
    )


def throughput(quick):
    if not on_gpu():
        return "SKIP", "needs a GPU (tokens/s and MFU against the card's peak)"
    import jax

    from ebpo_jax import models

    config = models.get_config("qwen3_0_6b", dtype="bfloat16", param_dtype="bfloat16")
    config = config.replace(attention="auto", remat="full")
    params = models.init_params(config, jax.random.key(0))
    gpu = card()
    lines = [_decode_line(config, params, quick, gpu), _update_line(config, params, quick, gpu)]
    return "OK", "; ".join(lines)


def _timed(fn) -> float:
    """Seconds of fn's second call (the first compiles)."""
    import jax

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def _decode_line(config, params, quick, gpu) -> str:
    """Decode: 256 rows, 512 prompt + 512 new tokens (no EOS: every row decodes every step)."""
    import jax
    import numpy as np

    from ebpo_jax import sampler
    from ebpo_jax.pods import aot_report

    B, Tp, N = (64, 256, 256) if quick else (256, 512, 512)
    prompts = np.random.default_rng(0).integers(1, config.vocab_size, (B, Tp), dtype=np.int32)
    lengths = np.full((B,), Tp, np.int32)
    spec = sampler.SamplerSpec(max_new_tokens=N)
    dt = _timed(
        lambda: (
            sampler.generate(config, params, prompts, lengths, spec, rng=jax.random.key(0)).tokens
        )
    )
    m = aot_report.matmul_params(config)
    flops = 2.0 * (m["layers"] + m["head"]) * B * (Tp + N)
    line = f"decode {B * N / dt:,.0f} tok/s ({B} rows, {Tp}+{N}), {dt:.2f} s per generate"
    if gpu:
        kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
        bytes_step = 2 * aot_report.total_params(config) + 2 * B * (Tp + N) * kv_per_token
        bound = N * bytes_step / gpu.hbm_bandwidth
        line += f", MFU {flops / dt / gpu.peak_flops:.1%}, HBM-bound floor {bound:.2f} s"
    return line


def _update_line(config, params, quick, gpu) -> str:
    """Update: P x G rows through the grouped forward + backward + AdamW."""
    from ebpo_jax.pods import aot_report

    P, G, Tp, N = (4, 4, 512, 1024) if quick else (8, 4, 1024, 2048)
    update = _update_fn(config, P, G, Tp, N)
    batch = _batch(config, P, G, Tp, N)
    dt = _timed(lambda: update(params, batch))
    m = aot_report.matmul_params(config)
    tokens = P * Tp + P * G * N
    flops = 6.0 * m["layers"] * tokens + 6.0 * m["head"] * P * G * N
    attention = aot_report.attention_flops(config, Tp, Tp, causal=True)
    attention += G * aot_report.attention_flops(config, N, Tp + N, causal=False)
    flops += 3 * P * attention
    line = f"update {tokens / dt:,.0f} tok/s ({P} prompts of {Tp} x {G} completions of {N})"
    if gpu:
        line += f", MFU {flops / dt / gpu.peak_flops:.1%} of {gpu.peak_flops / 1e12:.0f} TFLOP/s"
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller throughput shapes")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    import jax

    devices = jax.devices()
    print(f"backend {jax.default_backend()}: {len(devices)} x {devices[0].device_kind}")
    check("micro config end to end")(micro_end_to_end)
    check("HF parity")(hf_parity)
    check("sampler == forward log-probs")(sampler_equals_forward)
    check("update, cuDNN vs XLA attention")(cudnn_update_vs_xla)
    check("throughput")(lambda: throughput(args.quick))
    failed = RESULTS.count("FAIL")
    print(
        f"{len(RESULTS) - failed - RESULTS.count('SKIP')} OK, {failed} FAIL, "
        f"{RESULTS.count('SKIP')} SKIP"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
