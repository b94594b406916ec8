"""Jitted EBPO update step vs an equivalent PyTorch step (transformers Llama, same PPO loss, AdamW).

Prints tokens/s of both (median of alternating runs), their ratio, and the JAX step's FLOP/s
as a fraction of a large float32 matmul's FLOP/s measured in the same process. The JAX step
runs each prompt once per group (`models.forward_grouped`); the PyTorch step packs prompt and
completion into each row, as transformers users do, so it repeats the prompt G times. Both
count the same tokens (the packed rows); the FLOP/s counts the work the JAX step does.
Run: python benchmarks/train_bench.py [--hidden 256 --layers 4 --prompts 4 --group 8]
"""

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/
from configs import micro
from ebpo_jax import models
from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.spec import resolve
from ebpo_jax.trainer.state import init_train_state, make_optimizer
from ebpo_jax.trainer.update import make_update_fn


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=48)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--scan_unroll", type=int, default=0, help="0: all layers (as configs/tiny.py)")
    p.add_argument("--matmul_n", type=int, default=2048, help="the reference matmul's size")
    return p.parse_args(argv)


def setup_parts(a):
    """(config, model config, random Rollout) of the benchmark's sizes."""
    c = micro.get_config()
    c.unlock()
    c.prompts_per_step, c.group_size = a.prompts, a.group
    c.sampler.max_new_tokens = a.new_tokens
    # The config's model checks the sampler's lengths: give it the positions this model has.
    c.model.overrides.max_position_embeddings = a.prompt_len + a.new_tokens
    c.optimizer.weight_decay = 0.01
    mc = models.get_config(
        "tiny",
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_layers=a.layers,
        num_heads=a.hidden // 32,
        num_kv_heads=a.hidden // 64,
        head_dim=32,
        max_position_embeddings=a.prompt_len + a.new_tokens,
        scan_unroll=a.scan_unroll or a.layers,
    )
    rng = np.random.default_rng(0)
    P, G, Tp, N = a.prompts, a.group, a.prompt_len, a.new_tokens
    ro = Rollout(
        prompt_tokens=jnp.asarray(rng.integers(3, a.vocab, (P, Tp)), jnp.int32),
        prompt_lengths=jnp.full((P,), Tp, jnp.int32),
        answer_tokens=jnp.zeros((P, 1), jnp.int32),
        answer_lengths=jnp.ones((P,), jnp.int32),
        index=jnp.arange(P, dtype=jnp.int32),
        cluster_ids=jnp.zeros((P,), jnp.int32),
        tokens=jnp.asarray(rng.integers(3, a.vocab, (P, G, N)), jnp.int32),
        logprobs=jnp.full((P, G, N), -np.log(a.vocab), jnp.float32),
        lengths=jnp.full((P, G), N, jnp.int32),
        rewards=jnp.asarray(rng.integers(0, 2, (P, G)), jnp.float32),
        group_valid=jnp.ones((P,), bool),
        generated_tokens=jnp.int32(P * G * N),
        all_same_frac=jnp.float32(0),
        action_mask=jnp.ones((P, G, N), bool),
    )
    return c, mc, ro


def jax_setup(a):
    c, mc, ro = setup_parts(a)
    spec = resolve(c)
    opt = make_optimizer(spec.optim)
    state = init_train_state(models.init_params(mc, jax.random.key(0)), opt, seed=0)
    update = jax.jit(make_update_fn(spec.update, mc, opt, eos_id=2), donate_argnums=0)
    return mc, ro, state, update


def torch_setup(a, mc, ro):
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_kv_heads,
        head_dim=32,
        rope_theta=mc.rope_theta,
        max_position_embeddings=mc.max_position_embeddings,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    G = a.group
    prompt = torch.as_tensor(np.repeat(np.asarray(ro.prompt_tokens), G, 0), dtype=torch.long)
    comp = torch.as_tensor(np.asarray(ro.tokens).reshape(-1, a.new_tokens), dtype=torch.long)
    ids = torch.cat([prompt, comp], 1)
    old = torch.as_tensor(np.asarray(ro.logprobs).reshape(-1, a.new_tokens))
    r = torch.as_tensor(np.asarray(ro.rewards))
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1, 1)

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits[:, a.prompt_len - 1 : -1].float()
        logp_all = torch.log_softmax(logits, -1)
        logp = logp_all.gather(-1, comp[..., None])[..., 0]
        with torch.no_grad():
            (-(logp_all.exp() * logp_all).sum(-1)).mean()  # entropy metric, as the JAX step
        ratio = torch.exp(logp - old)
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def step_flops(mc, P, G, Tp, N):
    """Forward+backward FLOPs of the JAX step, which runs each prompt once per group: 6 x matmul
    params x tokens, attention (prompt over itself, completions over prompt + themselves), head."""
    D, L, H, hd, F = mc.hidden_size, mc.num_layers, mc.num_heads, mc.head_dim, mc.intermediate_size
    per_layer = D * H * hd * 2 + D * mc.num_kv_heads * hd * 2 + 3 * D * F
    tokens = P * Tp + P * G * N
    key_pairs = P * Tp * Tp + P * G * N * (Tp + N)  # full (unmasked) score matrices
    attn = 2 * 2 * L * key_pairs * H * hd  # QK^T and PV
    return 6 * L * per_layer * tokens + 3 * attn + 6 * D * mc.vocab_size * P * G * N


def matmul_flops_per_s(n=2048, runs=5):
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times)


def main(argv=None):
    a = parse(argv)
    mc, ro, state, update = jax_setup(a)
    torch_step = torch_setup(a, mc, ro)
    state, m = update(state, ro)  # compile
    jax.block_until_ready(m)
    torch_step()
    # Each round times two calls per framework: the first right after the other framework's
    # call (whose worker threads may still hold the 2 cores), the second in the steady state a
    # training loop sees. Rounds alternate so that outside load hits both alike.
    times = {"jax": ([], []), "torch": ([], [])}

    def jax_call():
        nonlocal state
        state, m = update(state, ro)
        jax.block_until_ready(m)

    for _ in range(a.runs):
        for name, call in (("jax", jax_call), ("torch", torch_step)):
            for timed in times[name]:
                t = time.perf_counter()
                call()
                timed.append(time.perf_counter() - t)
    (j_switch, jt), (t_switch, tt) = times["jax"], times["torch"]
    B, T = a.prompts * a.group, a.prompt_len + a.new_tokens
    tokens = B * T
    j_tps, t_tps = tokens / statistics.median(jt), tokens / statistics.median(tt)
    flops = step_flops(mc, a.prompts, a.group, a.prompt_len, a.new_tokens)
    flops /= statistics.median(jt)
    mm = matmul_flops_per_s(a.matmul_n)
    print(f"update step: {B} sequences x {T} tokens, {a.layers} layers, hidden {a.hidden}")
    print(f"scan_unroll {mc.scan_unroll}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"jax   {j_tps:10.0f} tokens/s  (median {statistics.median(jt) * 1e3:.1f} ms)")
    print(f"torch {t_tps:10.0f} tokens/s  (median {statistics.median(tt) * 1e3:.1f} ms)")
    print(f"ratio jax/torch: {j_tps / t_tps:.2f}x (steady state)")
    switch = statistics.median(t_switch) / statistics.median(j_switch)
    print(f"ratio jax/torch right after the other framework's call: {switch:.2f}x")
    print(f"jax step {flops / 1e9:.1f} GFLOP/s vs matmul {mm / 1e9:.1f} GFLOP/s: {flops / mm:.0%}")


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    main()
