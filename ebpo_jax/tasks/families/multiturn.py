"""The multi-turn toy families: `calculator` (reasoning problems with a calculator tool) and
`guess` (guess the number from higher/lower hints). Each is a generated-problem family
(task_arithmetic.build_synthetic: SFT warm start, EB clusters) plus an environment, and an
evaluator that plays whole held-out episodes.
"""

import dataclasses
import functools

import jax
import numpy as np

from ebpo_jax.spec import TaskSpec
from ebpo_jax.tasks import calc, encode_problems, envs, episodes, guess
from ebpo_jax.tasks.envs.pool import EnvPool
from ebpo_jax.tasks.families import arithmetic as task_arithmetic
from ebpo_jax.tasks.protocol import Task


def make_episode_evaluator(spec: TaskSpec, task: Task, problems, reward_fn):
    """evaluate(params) -> {"heldout": pass@1}: `spec.eval.run.eval_samples` episodes per held-out
    problem at the eval temperature, scored like training episodes (task + env reward)."""
    ev, tok = spec.eval, task.tokenizer
    sampling = dataclasses.replace(spec.rollout.sampler, temperature=ev.run.eval_temperature)
    ro = dataclasses.replace(spec.rollout, sampler=sampling)
    stops = episodes.stop_token_ids(tok, task.env)
    data = encode_problems(problems, tok)
    k = ev.samples_per_problem
    rep = lambda x: np.repeat(np.asarray(x), k, axis=0)
    prompt_BT, plen_B = rep(data.prompt_tokens), rep(data.prompt_lengths)
    ans_BA, alen_B = rep(data.answer_tokens), rep(data.answer_lengths)
    answers = episodes.answers_text(tok, ans_BA, alen_B)
    reward = jax.jit(reward_fn)

    def evaluate(params) -> dict[str, float]:
        turns = functools.partial(
            episodes.make_turns, ro, task.model_config, params, task.stop_ids, stops
        )
        scores = []
        with EnvPool(ro.rollout.env_workers, timeout_s=ro.rollout.env_timeout_s) as pool:
            for c, lo in enumerate(range(0, len(plen_B), ev.run.eval_batch_size)):
                sl = slice(lo, lo + ev.run.eval_batch_size)
                key = jax.random.fold_in(jax.random.key(ev.run.seed), c)
                prompts = episodes.EpisodePrompts(prompt_BT[sl], plen_B[sl], answers[sl])
                side = episodes.EnvSide(task.env, pool, tok, task.stop_ids)
                ep = episodes.run_episodes(turns(), ro, side, prompts, key)
                r = np.asarray(reward(ep.tokens, ep.lengths, ans_BA[sl], alen_B[sl]))
                scores.append(r + ep.env_reward)
        return {"heldout": float(np.concatenate(scores).mean())}

    return evaluate


def build_family(spec: TaskSpec, module, env_name: str, *, mesh=None, log=print) -> Task:
    """A generated-problem family with environment `env_name` and an episode evaluator
    (its settings are checked by spec_checks: MULTI_TURN_FAMILIES)."""
    tok = module.make_tokenizer()
    reward_fn = functools.partial(module.reward_fn, eos_id=tok.eos_id)
    task = task_arithmetic.build_synthetic(spec, module, tok, module.reward_fn, mesh=mesh, log=log)
    task = task._replace(env=envs.get(env_name))
    _, _, test = task_arithmetic.load_problems(spec, module, tok)
    return task._replace(evaluate=make_episode_evaluator(spec, task, test, reward_fn))


def build_calculator(spec: TaskSpec, *, mesh=None, log=print) -> Task:
    """Reasoning problems with the calculator tool."""
    return build_family(spec, calc, "calculator", mesh=mesh, log=log)


def build_guess(spec: TaskSpec, *, mesh=None, log=print) -> Task:
    """Guess the number from higher/lower hints."""
    return build_family(spec, guess, "guess", mesh=mesh, log=log)
