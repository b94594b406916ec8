"""DAPO's dynamic sampling when the host scores the groups (math-verify, multi-turn episodes).

The step's batch holds `1 + dapo.max_extra_rounds` rounds of P prompts, as on the jittable
path. Round r (its P prompts, key fold_in(rng, r)) is sampled by a jitted program, scored on
the host, and its spread groups fill the buffer's empty slots in order (`rollout.absorb`, the
jittable path's own merge), until P groups are kept or the rounds run out; then the step trains
on the kept groups with the empty slots masked (`group_valid`), and says so once. A round is
one sampler call: a group can be scored only when its last sample ends, and the engine's loop
is one jitted program, so refill prompts wait for the round to finish rather than take slots
as they free up. Nothing of a step's rounds is saved: they are a function of the checkpointed
params, batch (data position) and rng, so a step killed mid-refill reruns them bit for bit.
"""

import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax.rollout import single_turn as rollout_lib
from ebpo_jax.rollout.single_turn import Rollout
from ebpo_jax.runtime import distributed
from ebpo_jax.spec import RolloutSpec


def kept_tokens(ro: Rollout) -> jax.Array:
    """Tokens the update trains on: action tokens of the valid groups."""
    N = ro.tokens.shape[-1]
    in_len = jnp.arange(N) < ro.lengths[..., None]
    return (in_len & ro.action_mask & ro.group_valid[:, None, None]).sum()


class HostRefill:
    """refill(next_round) -> the step's Rollout; `last_metrics` holds its dapo/* metrics."""

    def __init__(self, spec: RolloutSpec, sh):
        self.spec = spec
        rep = sh.replicated
        self.absorb = jax.jit(rollout_lib.absorb, out_shardings=(sh.rollout, rep, rep, rep))
        self.finish = jax.jit(
            lambda *a: (lambda ro: (ro, kept_tokens(ro)))(rollout_lib.finish_refill(*a)),
            out_shardings=(sh.rollout, rep),
        )
        self.last_metrics: dict[str, float] = {}
        self.warned = False

    def __call__(self, next_round: Callable[[int], Rollout]) -> Rollout:
        """`next_round(r)`: round r's Rollout on the trainer mesh, its rewards filled in."""
        spec, P = self.spec, self.spec.prompts
        first = next_round(0)
        acc = self.absorb(first, np.zeros((P,), bool), np.int32(0), np.int32(0), first)
        r = 1
        while r < spec.rounds and not distributed.to_host(acc[1]).all():
            acc = self.absorb(*acc, next_round(r))
            r += 1
        ro, kept_tok = self.finish(*acc[:2], jnp.int32(r), *acc[2:])
        filled, ntok, nsame, kept_tok = distributed.to_host((acc[1], acc[2], acc[3], kept_tok))
        kept = int(filled.sum())
        self.last_metrics = {
            "dapo/rounds": float(r),
            "dapo/kept_groups": float(kept),
            "dapo/dropped_groups": float(nsame),
            "dapo/unfilled_groups": float(P - kept),
            # NaN (no row in metrics.jsonl's numbers) when no group spread: nothing was kept.
            "dapo/generated_per_kept": float(ntok) / int(kept_tok) if kept_tok else float("nan"),
        }
        if kept < P and not self.warned:
            self.warned = True
            print(
                f"dynamic sampling: {kept} of {P} groups spread after {r} rounds "
                f"(dapo.max_extra_rounds={spec.dapo.max_extra_rounds}); the step trains on those, "
                "the rest masked (dapo/unfilled_groups counts them each step)",
                file=sys.stderr,
                flush=True,
            )
        return ro
