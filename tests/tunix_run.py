"""Run by tests/tunix_test.py inside a venv with google-tunix 0.1.7: EBPO through tunix's registry.

Prints one JSON line: what was checked; any mismatch raises.
"""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
from flax import nnx
from tunix.rl import function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner as grpo_lib
from tunix.rl.rollout import base_rollout
from tunix.tests import test_common as tc

import ebpo_jax
from ebpo_jax.advantages import merge_batch
from ebpo_jax.integrations import tunix as ebpo_tunix

G = 4


def registry_stream(batches=20, prompts=6):
    """tunix's get_advantage_estimator("ebpo") over a stream equals eb_advantage on it, exactly."""
    ebpo_tunix.register("ebpo", normalize="batch")
    estimator = function_registry.get_advantage_estimator("ebpo")
    rng, state = np.random.default_rng(0), ebpo_jax.init_eb_state()
    for _ in range(batches):
        rewards_PG = (rng.random((prompts, G)) < rng.random((prompts, 1))).astype(np.float32)
        got = estimator(rewards=rewards_PG.reshape(-1), num_generations=G)
        want, state = ebpo_jax.eb_advantage(rewards_PG, state)
        np.testing.assert_array_equal(got, np.asarray(want).reshape(-1))
    return batches


def _cluster():
    vocab = tc.MockVocab()
    model_config = tc.ModelConfig(vocab_size=vocab.GetPieceSize())
    model = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
    ref = tc.ToyTransformer(config=model_config, rngs=nnx.Rngs(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl_cluster_lib.Role.ACTOR, rl_cluster_lib.Role.REFERENCE, rl_cluster_lib.Role.ROLLOUT)
    config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={role: mesh for role in roles},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optax.sgd(1e-3),
            eval_every_n_steps=2,
            max_steps=4,
            # One prompt per rollout micro-batch, two per optimizer step: tunix then calls
            # the estimator twice per training step.
            mini_batch_size=2,
            train_micro_batch_size=1,
            rollout_micro_batch_size=1,
            compute_logps_micro_batch_size=1,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=6, max_prompt_length=16, kv_cache_size=64
        ),
    )
    cluster = rl_cluster_lib.RLCluster(
        actor=model, reference=ref, tokenizer=vocab, cluster_config=config
    )
    return cluster, model


def replay(calls, stream):
    """Each call against eb_advantage: training micro-batches score against the state at their
    step's start, which takes the step's rewards once, at its end; eval calls change nothing."""
    equal = lambda a, b: jax.tree.map(np.testing.assert_array_equal, a, b)
    state, pending = ebpo_jax.init_eb_state(), []
    for rewards, adv, training, seen in calls:
        equal(seen, state)
        want, _ = ebpo_jax.eb_advantage(rewards.reshape(-1, 2), state)
        np.testing.assert_array_equal(adv, np.asarray(want).reshape(-1))
        pending += [rewards.reshape(-1, 2)] if training else []
        if sum(len(r) for r in pending) == 2:  # prompts_per_step
            state, pending = merge_batch(state, np.concatenate(pending)), []
    equal(stream.state, state)


def grpo_run():
    """A tiny tunix GRPO run on CPU with advantage_estimator="ebpo"; its calls replayed."""
    stream = ebpo_tunix.register("ebpo_run", prompts_per_step=2)
    estimator, calls = function_registry.get_advantage_estimator("ebpo_run"), []

    def recorded(rewards, num_generations):
        state, adv = stream.state, estimator(rewards=rewards, num_generations=num_generations)
        calls.append((np.asarray(rewards, np.float32), adv, stream.training, state))
        return adv

    function_registry.register_advantage_estimator("ebpo_recorded")(recorded)
    cluster, model = _cluster()
    config = grpo_lib.GRPOConfig(num_generations=2, advantage_estimator="ebpo_recorded")
    # One success per group of 2, so every group has a non-zero advantage to learn from.
    reward = lambda prompts, completions, **_: [float(i % 2) for i in range(len(completions))]
    learner = grpo_lib.GRPOLearner(rl_cluster=cluster, reward_fns=reward, algo_config=config)
    ebpo_tunix.track_mode(learner, stream)
    words = np.array(["input string", "hello world", "My name", "hello there"] * 2)
    batch = lambda i: {"prompts": words[i : i + 2], "answer": words[i : i + 2]}
    before = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    learner.train([batch(i) for i in range(0, 8, 2)], [batch(0)])
    after = nnx.state(cluster.actor_trainer.model, nnx.Param)  # tunix reshards a copy
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), before, after))
    assert stream.state.reward.count[0] == 4 * 2 * 2  # 4 steps x 2 prompts x G=2: no eval
    replay(calls, stream)
    assert any(moved), "the GRPO steps did not change the policy"
    train_calls = sum(training for _, _, training, _ in calls)
    assert train_calls == 8 and len(calls) > train_calls, [c[2] for c in calls]
    return {
        "train_calls": train_calls,
        "eval_calls": len(calls) - train_calls,
        "params_moved": any(moved),
    }


if __name__ == "__main__":
    print(json.dumps({"stream_batches": registry_stream(), "grpo": grpo_run()}))
