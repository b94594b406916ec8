"""LoRA: sampler on merged weights vs the adapter path, and update-step memory LoRA vs full.

Sampler: seconds per rollout (`sampler.generate` of P prompts x G samples), the merged path
including its `lora.merge`; median of alternating runs, ratio measured in one process.
Memory: the compiled programs' `memory_analysis()`: optimizer state = the output bytes of the
compiled `optimizer.init` (the trainer's AdamW); update = a gradient step (the trainer's loss
pieces: completion_logprobs + policy_loss, then AdamW) on full params vs on the adapters.
Run: python benchmarks/lora_bench.py [--hidden 128 --layers 2 --rank 8]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from ebpo_jax import config as config_lib
from ebpo_jax import losses, models, sampler, schema
from ebpo_jax.models import lora
from ebpo_jax.spec import optim_spec
from ebpo_jax.trainer.batch import MicroBatch
from ebpo_jax.trainer.state import make_optimizer
from ebpo_jax.trainer.update import completion_logprobs


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--mlp", type=int, default=384)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--new_tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=7)
    return p.parse_args(argv)


def sampler_times(mc, spec, args):
    """{path: median seconds per rollout} for the merged and the adapter path."""
    base = models.init_params(mc, jax.random.key(0))
    adapters = lora.init_adapters(mc, spec, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.01, adapters)
    prompts = jax.random.randint(
        jax.random.key(2), (args.prompts, args.prompt_len), 1, mc.vocab_size
    )
    lengths = jnp.full((args.prompts,), args.prompt_len, jnp.int32)
    merge = jax.jit(lambda b, a: lora.merge(b, a, spec, dtype=mc.dtype))

    def run(path, seed):
        params = merge(base, adapters) if path == "merged" else lora.attach(base, adapters, spec)
        s_spec = sampler.SamplerSpec(max_new_tokens=args.new_tokens, num_samples=args.group)
        gen = sampler.generate(mc, params, prompts, lengths, s_spec, rng=jax.random.key(seed))
        return jax.block_until_ready(gen.tokens)

    times = {"merged": [], "adapter": []}
    for path in times:  # compile
        run(path, 0)
    for i in range(args.runs):
        for path, runs in times.items():
            t0 = time.perf_counter()
            run(path, i + 1)
            runs.append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _update(mc, optimizer, lora_spec, args):
    """One gradient step as the trainer takes it, on params (full) or on adapters (LoRA)."""
    P, G, N = args.prompts, args.group, args.new_tokens

    def step(train, opt_state, frozen, ro):
        def loss_fn(train):
            policy = train if lora_spec is None else lora.attach(frozen, train, lora_spec)
            mb = MicroBatch(ro["prompt"], ro["plen"], ro["comp"], ro["clen"])
            logp = completion_logprobs(mc, policy, mb, with_entropy=False)
            mask = jnp.arange(N)[None] < ro["clen"][:, None]
            return losses.policy_loss(losses.TokenTerms(logp, ro["old"], ro["adv"], mask))[0]

        grads = jax.grad(loss_fn)(train)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        return optax.apply_updates(train, updates), opt_state

    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    ro = {"prompt": i32(P, args.prompt_len), "plen": i32(P), "comp": i32(P * G, N),
          "clen": i32(P * G), "old": f32(P * G, N), "adv": f32(P * G)}  # fmt: skip
    return step, ro


def memory(mc, spec, args):
    """{mode: (optimizer-state bytes, update argument bytes, update temp bytes)}."""
    optimizer = make_optimizer(optim_spec(schema.parse(config_lib.default_config())))
    base = models.abstract_params(mc)
    out = {}
    for mode, s in (("full", None), ("lora", spec)):
        train = base if s is None else lora.abstract_adapters(mc, s)
        init = jax.jit(optimizer.init).lower(train).compile().memory_analysis()
        opt_state = jax.eval_shape(optimizer.init, train)
        step, ro = _update(mc, optimizer, s, args)
        frozen = None if s is None else base
        compiled = (
            jax.jit(step, donate_argnums=(0, 1)).lower(train, opt_state, frozen, ro).compile()
        )
        m = compiled.memory_analysis()
        out[mode] = (init.output_size_in_bytes, m.argument_size_in_bytes, m.temp_size_in_bytes)
    return out


def main(argv=None):
    args = parse(argv)
    mc = models.get_config(
        "tiny", hidden_size=args.hidden, intermediate_size=args.mlp, num_layers=args.layers,
        vocab_size=args.vocab, scan_unroll=args.layers, max_position_embeddings=512,
    )  # fmt: skip
    spec = lora.LoraSpec(args.rank, 2.0 * args.rank, tuple(lora.TARGETS))
    print(f"adapter params {lora.num_adapter_params(mc, spec):,} of {models.hf.param_count(mc):,}")
    t = sampler_times(mc, spec, args)
    print(
        f"sampler, {args.prompts} prompts x {args.group} x {args.new_tokens} new tokens: "
        f"merged {t['merged'] * 1e3:.1f} ms, adapter path {t['adapter'] * 1e3:.1f} ms "
        f"(adapter / merged = {t['adapter'] / t['merged']:.2f})"
    )
    mem = memory(mc, spec, args)
    for mode, (opt, arg, tmp) in mem.items():
        print(f"{mode}: optimizer state {opt:,} B; update args {arg:,} B, temp {tmp:,} B")
    print(
        f"LoRA / full: optimizer state {mem['lora'][0] / mem['full'][0]:.4f}, "
        f"update args + temp {sum(mem['lora'][1:]) / sum(mem['full'][1:]):.3f}"
    )
    print("the trainer samples the merged weights (trainer/policy.py: Policy.sampled)")


if __name__ == "__main__":
    main()
