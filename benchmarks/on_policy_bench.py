"""The batch-invariant mode's cost (issue 47): update and decode tokens/s with
`ModelConfig.batch_invariant` off and on, in alternating runs of one process, and their ratios.

Also the sampler-vs-trainer gap each way (max |log-prob difference| of the sampled tokens),
which is 0.0 with the mode on. Sizes as benchmarks/train_bench.py (its flags).
Run: python benchmarks/on_policy_bench.py [--hidden 256 --layers 4 --runs 5]
"""

import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # train_bench
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/
import train_bench  # noqa: E402

from ebpo_jax import models, sampler  # noqa: E402
from ebpo_jax.spec import resolve  # noqa: E402
from ebpo_jax.trainer.batch import MicroBatch  # noqa: E402
from ebpo_jax.trainer.state import init_train_state, make_optimizer  # noqa: E402
from ebpo_jax.trainer.update import completion_logprobs, make_update_fn  # noqa: E402

MODES = {"off": False, "on": True}


class Mode:
    """One mode's jitted sampler and update around the same weights and rollout."""

    def __init__(self, a, c, mc, ro, on: bool):
        self.mc = dataclasses.replace(mc, batch_invariant=on)
        P, G, N = a.prompts, a.group, a.new_tokens
        spec = resolve(c)
        opt = make_optimizer(spec.optim)
        self.params = models.init_params(self.mc, jax.random.key(0))
        s_spec = sampler.SamplerSpec(max_new_tokens=N, num_samples=G)
        self.generate = jax.jit(
            lambda p, tokens, lengths, key: sampler.generate(
                self.mc, p, tokens, lengths, s_spec, rng=key
            )
        )
        gen = self.generate(self.params, ro.prompt_tokens, ro.prompt_lengths, jax.random.key(1))
        shape = lambda x, *tail: x.reshape(P, G, *tail)
        self.ro = ro._replace(
            tokens=shape(gen.tokens, N), logprobs=shape(gen.logprobs, N), lengths=shape(gen.lengths)
        )
        self.gap = self._gap(gen)
        self.update = jax.jit(make_update_fn(spec.update, self.mc, opt, eos_id=2), donate_argnums=0)
        self.state = init_train_state(jax.tree.map(lambda x: x.copy(), self.params), opt, seed=0)
        self.run_update(), self.run_decode()  # compile

    def _gap(self, gen) -> float:
        """max |sampler - trainer| log-prob over the sampled tokens."""
        ro = self.ro
        mb = MicroBatch(ro.prompt_tokens, ro.prompt_lengths, ro.tokens, ro.lengths)
        new = completion_logprobs(self.mc, self.params, mb, with_entropy=False)
        mask = np.arange(new.shape[-1])[None] < np.asarray(gen.lengths)[:, None]
        return float(np.abs(np.where(mask, np.asarray(new) - np.asarray(gen.logprobs), 0)).max())

    def run_update(self):
        self.state, m = self.update(self.state, self.ro)
        jax.block_until_ready(m)

    def run_decode(self):
        ro = self.ro
        out = self.generate(self.params, ro.prompt_tokens, ro.prompt_lengths, jax.random.key(2))
        jax.block_until_ready(out.tokens)


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return time.perf_counter() - t


def measure(a) -> dict:
    """Median seconds of each mode's update and decode (alternating runs), and its gap."""
    c, mc, ro = train_bench.setup_parts(a)
    modes = {name: Mode(a, c, mc, ro, on) for name, on in MODES.items()}
    times = {(name, what): [] for name in MODES for what in ("update", "decode")}
    for _ in range(a.runs):  # alternating, so outside load hits both modes alike
        for name, m in modes.items():
            times[name, "update"].append(_timed(m.run_update))
            times[name, "decode"].append(_timed(m.run_decode))
    out = {key: statistics.median(t) for key, t in times.items()}
    return out | {(name, "gap"): m.gap for name, m in modes.items()}


def main(argv=None):
    a = train_bench.parse(argv)
    r = measure(a)
    P, G, N, T = a.prompts, a.group, a.new_tokens, a.prompt_len + a.new_tokens
    tokens = {"update": P * G * T, "decode": P * G * N}
    print(f"{P * G} rows, prompt {a.prompt_len} + {N} new, {a.layers} layers, hidden {a.hidden}")
    for what, n in tokens.items():
        off, on = n / r["off", what], n / r["on", what]
        print(f"{what:6s} tokens/s  off {off:10.0f}  on {on:10.0f}  on/off {on / off:.3f}")
    print(f"sampler vs trainer max |dlogp|  off {r['off', 'gap']:.3g}  on {r['on', 'gap']:.3g}")


if __name__ == "__main__":
    from ebpo_jax.runtime.cpu_flags import add_cpu_flags

    add_cpu_flags()  # XLA:CPU flags, before jax starts a backend
    main()
