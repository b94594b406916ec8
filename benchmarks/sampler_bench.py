"""Sampler speed: generate vs transformers generate, and decode FLOP/s vs a large matmul.

Run: .venv-test/bin/python benchmarks/sampler_bench.py [--runs 5] [--decode-runs 3]  (torch: make install-test)
Both generators run greedy on the same random checkpoint (hidden 256, 4 layers, vocab 512),
batch 64, prompt 32, 64 new tokens, in alternating runs; compile time is excluded (one
warm-up call each). HF's own model FLOP/s is compared with a large f32 matmul's FLOP/s
measured in this same process (which bounds the ratio any generate can reach here). Then
decode alone at batch 256 is timed and its model FLOP/s compared with the same matmul.
"""

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from ebpo_jax import models, sampler
from ebpo_jax.sampler import engine

HF_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def build_checkpoint(seed=0, hf_config=HF_CONFIG):
    """A random HF Llama and the same weights as (config, params)."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config)).eval()
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        config, params = models.from_hf(path, dtype="float32")
    return hf, config, params


def timed(fn, *args, **kwargs):
    """(seconds, result) of fn(*args, **kwargs), waiting for device work to finish."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return time.perf_counter() - start, out


def compare_with_hf(hf, config, params, batch, prompt_len, new_tokens, runs):
    """Median over alternating runs of generate's and HF's tokens/s, and their ratio."""
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (batch, prompt_len), dtype=np.int32)
    lengths = np.full((batch,), prompt_len, np.int32)

    def ours():
        spec = sampler.SamplerSpec(max_new_tokens=new_tokens, sampling=sampler.Sampling(0.0))
        return sampler.generate(
            config, params, prompts, lengths, spec, rng=jax.random.key(0)
        ).tokens

    ids = torch.from_numpy(prompts.astype(np.int64))

    def theirs():
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return out[:, prompt_len:].numpy()

    _, ours_tokens = timed(ours)
    hf_tokens = theirs()
    agree = float(np.mean(np.asarray(ours_tokens) == hf_tokens))
    # Per run, two calls each: the first follows the other library's call (whose worker
    # threads may still hold the cores), the second is the steady state a sampler loop sees.
    ours_s, theirs_s, switch = [], [], []
    for _ in range(runs):
        first_ours, _ = timed(ours)
        ours_s.append(timed(ours)[0])
        first_theirs, _ = timed(theirs)
        theirs_s.append(timed(theirs)[0])
        switch.append(first_theirs / first_ours)
    ratios = [t / o for o, t in zip(ours_s, theirs_s)]
    n = batch * new_tokens
    return {
        "ours_tok_s": n / statistics.median(ours_s),
        "hf_tok_s": n / statistics.median(theirs_s),
        "ratio": statistics.median(ratios),
        "switch_ratio": statistics.median(switch),
        "token_agreement": agree,
    }


def _token_flops(config):
    """(layer matmul FLOPs, head FLOPs, attention FLOPs per attended key) for one token."""
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (2 * q_dim + 2 * kv_dim) + 3 * c.hidden_size * c.intermediate_size
    return 2 * c.num_layers * per_layer, 2 * c.hidden_size * c.vocab_size, 4 * c.num_layers * q_dim


def decode_flops(config, prompt_len, new_tokens):
    """Model FLOPs of decode steps 1..N-1 per row (matmuls + attention over the real context)."""
    layers, head, per_key = _token_flops(config)
    contexts = prompt_len + np.arange(1, new_tokens)
    return (layers + head) * (new_tokens - 1) + per_key * contexts.sum()


def generate_flops(config, prompt_len, new_tokens):
    """The least model FLOPs per row any generate must do: causal prefill, head at its last
    token only, then the decode steps."""
    layers, head, per_key = _token_flops(config)
    prefill = layers * prompt_len + head + per_key * prompt_len * (prompt_len + 1) // 2
    return prefill + decode_flops(config, prompt_len, new_tokens)


def decode_throughput(config, params, batch, prompt_len, new_tokens, runs):
    """Median FLOP/s of the decode loop alone (prefill excluded) at `batch` rows."""
    prompts = jnp.ones((batch, prompt_len), jnp.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)
    spec = sampler.SamplerSpec(max_new_tokens=new_tokens, sampling=sampler.Sampling(0.0))
    programs = sampler.Session(config, spec).programs(batch, prompt_len)
    eos = jnp.zeros((0,), jnp.int32)
    times = []
    for _ in range(runs + 1):
        state = programs["prefill"](params, prompts, lengths, jax.random.key(0))
        jax.block_until_ready(state)
        key = jax.random.key(0)
        state = engine.Prefilled(*state)
        seconds, _ = timed(programs["decode"], params, state, lengths, key, eos)
        times.append(seconds)
    return batch * decode_flops(config, prompt_len, new_tokens) / statistics.median(times[1:])


def matmul_throughput(n=2048, runs=5):
    """Median FLOP/s of an n x n x n float32 matmul."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    mm = jax.jit(jnp.dot)
    timed(mm, a, b)
    return 2 * n**3 / statistics.median(timed(mm, a, b)[0] for _ in range(runs))


# (batch, prompt_len, new_tokens, decode batch, matmul size): the measured sizes, and the
# smallest that run every line (--smoke: the script works; its figures mean nothing).
SIZES = (64, 32, 64, 256, 2048)
SMOKE_SIZES = (2, 4, 4, 2, 64)
SMOKE_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="alternating runs vs HF")
    parser.add_argument("--decode-runs", type=int, default=3, help="timed decode runs")
    parser.add_argument("--smoke", action="store_true", help="smallest sizes, one run each")
    args = parser.parse_args(argv)
    batch, prompt_len, new, decode_batch, n = SMOKE_SIZES if args.smoke else SIZES
    if args.smoke:
        args.runs = args.decode_runs = 1
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads"
    )
    hf, config, params = build_checkpoint(
        hf_config=HF_CONFIG | SMOKE_MODEL if args.smoke else HF_CONFIG
    )
    hf_result = compare_with_hf(hf, config, params, batch, prompt_len, new, args.runs)
    print(
        f"generate batch {batch}, prompt {prompt_len}, {new} new (greedy, compile excluded): "
        f"ours {hf_result['ours_tok_s']:.0f} tok/s, HF {hf_result['hf_tok_s']:.0f} tok/s, "
        f"median ratio {hf_result['ratio']:.2f}x steady state, "
        f"{hf_result['switch_ratio']:.2f}x right after the other library (target >= 3x); "
        f"token agreement with HF {hf_result['token_agreement']:.3f}"
    )
    matmul = matmul_throughput(n)
    # How fast HF already is bounds the ratio any implementation can reach on this CPU.
    hf_flops = batch * generate_flops(config, prompt_len, new) * hf_result["hf_tok_s"]
    hf_flops /= batch * new
    print(
        f"HF generate does {hf_flops / 1e9:.1f} GFLOP/s of model work, {hf_flops / matmul:.0%} "
        f"of the matmul below: 3x HF would need {3 * hf_flops / matmul:.0%} of it, so even "
        f"at the matmul's FLOP/s generate could be at most {matmul / hf_flops:.2f}x HF"
    )
    decode = decode_throughput(config, params, decode_batch, prompt_len, new, args.decode_runs)
    print(
        f"decode batch {decode_batch}: {decode / 1e9:.1f} GFLOP/s; {n}^3 f32 matmul "
        f"{matmul / 1e9:.1f} GFLOP/s; ratio {decode / matmul:.1%} (target >= 40%)"
    )


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    main()
