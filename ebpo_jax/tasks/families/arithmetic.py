"""The synthetic arithmetic family: char tokenizer, preset policy + SFT warm start, a jittable
exact-answer reward, EB clusters per topic or per (topic, difficulty) cell.

`build_synthetic` is shared with the other generated-problem families (task_reasoning): a
family there is its problem module (make_splits, TOPICS, DIFFICULTIES), tokenizer and reward.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ebpo_jax import models, tasks
from ebpo_jax.evaluation.evaluator import EvalSet, make_evaluator
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import TaskSpec
from ebpo_jax.tasks import difficulty, sft
from ebpo_jax.tasks.arithmetic import max_lengths
from ebpo_jax.tasks.protocol import VALIDATION, Reward, Task, model_config_from, tokenizer_vocab


def _splits(t, family, train_per_cell: int):
    """make_splits of the `task` section `t` with `train_per_cell` training problems per cell."""
    topics = tuple(x for x in t.topics.split(",") if x) or family.TOPICS
    levels = tuple(d for d in family.DIFFICULTIES if not t.max_difficulty or d <= t.max_difficulty)
    return family.make_splits(
        t.seed,
        train_per_cell=train_per_cell,
        test_per_cell=t.test_per_cell,
        topics=topics,
        difficulties=levels,
    )


def load_problems(spec: TaskSpec, family=tasks, tokenizer=None):
    """(tokenizer, train problems, held-out problems) of the `task` section for a generated
    family (a module with make_splits, TOPICS and DIFFICULTIES; default arithmetic)."""
    train, test = _splits(spec.task, family, spec.task.train_per_cell)
    return tokenizer or tasks.CharTokenizer(), train, test


def validation_problems(spec: TaskSpec, family=tasks) -> list:
    """Each cell's next `task.val_per_cell` problems after its training ones ([] when 0).

    A family's make_splits draws each cell in one seeded sequence (test first, then train),
    so asking for more training problems keeps the first ones: the extra ones are disjoint
    from train and test and leave both unchanged.
    """
    t = spec.task
    n = t.val_per_cell
    if not n:
        return []
    longer, _ = _splits(t, family, t.train_per_cell + n)
    out, seen = [], {}
    for p in longer:
        cell = (p.topic, p.difficulty)
        seen[cell] = seen.get(cell, 0) + 1
        if seen[cell] > t.train_per_cell:
            pid = f"validation/{p.topic}/{p.difficulty}/{len(out)}"
            out.append(dataclasses.replace(p, id=pid))
    return out


def num_clusters(eb_clusters: str, family=tasks) -> int:
    """EB priors: one, one per topic, or one per (topic, difficulty) cell."""
    topics, levels = len(family.TOPICS), len(family.DIFFICULTIES)
    return {"none": 1, "topic": topics, "cell": topics * levels}[eb_clusters]


def cluster_ids(eb_clusters: str, batch, levels: int = len(tasks.DIFFICULTIES)) -> jax.Array:
    """[P] int32 EB cluster of each prompt of a PromptBatch (`levels`: difficulty levels)."""
    topic = jnp.asarray(batch.topic_ids, jnp.int32)
    if eb_clusters == "topic":
        return topic
    if eb_clusters == "cell":
        return topic * levels + jnp.asarray(batch.difficulty, jnp.int32) - 1
    return jnp.zeros_like(topic)


def eval_set(problems, tokenizer, reward_fn, name: str = "heldout", bands: tuple = ()) -> EvalSet:
    """The held-out problems scored by the family's jittable reward (`bands`: per problem)."""
    data = tasks.encode_problems(problems, tokenizer)
    reward = jax.jit(functools.partial(reward_fn, eos_id=tokenizer.eos_id))

    def score(tokens, lengths):
        k = len(lengths) // len(problems)
        rep = lambda x: np.repeat(x, k, axis=0)
        r = reward(tokens, lengths, rep(data.answer_tokens), rep(data.answer_lengths))
        return np.asarray(r)

    meta = tuple((p.id, p.topic, p.difficulty) for p in problems)
    return EvalSet(name, data.prompt_tokens, data.prompt_lengths, score, problems=meta, bands=bands)


class Generated(NamedTuple):
    """A generated-problem family: its problem module, tokenizer and jittable reward."""

    module: Any
    tokenizer: Any
    reward_fn: Callable


def generated(family: str) -> Generated:
    """The generated family `family` (task.family; "" = arithmetic)."""
    from ebpo_jax.tasks import reasoning

    if family in ("", "arithmetic"):
        return Generated(tasks, tasks.CharTokenizer(), tasks.reward_fn)
    if family == "reasoning":
        return Generated(reasoning, reasoning.make_tokenizer(), reasoning.reward_fn)
    raise ConfigError(f"task.family={family!r}: not a generated family (arithmetic, reasoning)")


class WarmStart(NamedTuple):
    """The policy RL starts from: its model config, params and their SHA-256."""

    model_config: Any
    params: Any
    digest: str


def warm_start(spec: TaskSpec, fam: Generated, train_problems, *, log=print) -> WarmStart:
    """Preset init, then the SFT warm start (or the committed sft.params_file)."""
    model_config = model_config_from(spec.model, tokenizer_vocab(fam.tokenizer))
    prompt_len = max_lengths(train_problems)[0] + 1  # BOS + the longest prompt
    need = prompt_len + spec.max_new_tokens  # checked before the SFT warm start
    if need > model_config.max_position_embeddings:
        raise ConfigError(
            f"sampler.max_new_tokens={spec.max_new_tokens}: prompts of {prompt_len} "
            f"tokens + completions need {need} positions, the model has "
            f"{model_config.max_position_embeddings} (model max_position_embeddings)"
        )
    params = models.init_params(model_config, jax.random.key(sft.init_seed(spec)))
    params = sft.warm_start(
        spec, model_config, params, train_problems, fam.tokenizer, family=fam.module, log=log
    )
    try:
        return WarmStart(model_config, params, sft.check_digest(spec, params))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def estimate_difficulty(
    spec: TaskSpec, fam: Generated, warm: WarmStart, problems: dict, *, mesh=None, seed: int = 0
) -> list[dict]:
    """The difficulty file's rows of `problems` ({set: problems}): each problem's correct
    count over `task.difficulty_samples` samples of the warm start at temperature 1 (one
    evaluation over every set's problems, in order: one compile)."""
    n = spec.task.difficulty_samples
    every = [p for probs in problems.values() for p in probs]
    est = difficulty.estimate_spec(spec.eval, n, seed)
    one = eval_set(every, fam.tokenizer, fam.reward_fn, "all")
    evaluate = make_evaluator(est, warm.model_config, [one], fam.tokenizer.eos_id, mesh)
    scores = evaluate(warm.params, matrix=True)
    ends = np.cumsum([len(probs) for probs in problems.values()])[:-1]
    counts = np.split(scores["all"].sum(1), ends)
    return difficulty.records(problems, dict(zip(problems, counts)), n, warm.digest)


def file_difficulty(
    spec: TaskSpec, fam: Generated, warm: WarmStart, problems: dict, *, mesh=None, log=print
) -> dict | None:
    """{set: [n] difficulty} from `task.difficulty_file` ("auto": estimated from the warm start
    on first use, then read); None without one."""
    f = spec.task.difficulty_file
    if not f:
        return None
    digest = warm.digest
    path = difficulty.auto_path(spec, digest) if f == difficulty.AUTO else f
    if f == difficulty.AUTO:
        estimate = lambda: estimate_difficulty(spec, fam, warm, problems, mesh=mesh)
        difficulty.ensure(path, estimate, log)
    rows = difficulty.read(path)
    return {
        name: difficulty.lookup(rows, probs, name, path, digest) for name, probs in problems.items()
    }


def build_synthetic(spec: TaskSpec, family, tokenizer, reward_fn, *, mesh=None, log=print):
    """A generated-problem family's Task: preset init (+ SFT warm start), jittable reward; with
    `task.difficulty_file`, its difficulty orders training and bands the held-out problems."""
    tokenizer, train_problems, test_problems = load_problems(spec, family, tokenizer)
    fam = Generated(family, tokenizer, reward_fn)
    warm = warm_start(spec, fam, train_problems, log=log)
    model_config, params, digest = warm
    split = {difficulty.TRAIN: train_problems, difficulty.HELDOUT: test_problems}
    diff = file_difficulty(spec, fam, warm, split, mesh=mesh, log=log)
    source = tasks.PromptSource(
        train_problems,
        tokenizer,
        spec.batch_prompts,
        seed=spec.run.seed,
        order=spec.task.order,
        difficulty=None if diff is None else diff[difficulty.TRAIN],
    )
    eos = tokenizer.eos_id
    bands = (
        ()
        if diff is None
        else difficulty.quartiles(diff[difficulty.HELDOUT], [p.difficulty for p in test_problems])
    )
    sets = [eval_set(test_problems, tokenizer, reward_fn, bands=bands)]
    val = validation_problems(spec, family)
    if val:  # sampled in its own calls: the test set's draws stay the same
        sets.append(eval_set(val, tokenizer, reward_fn, VALIDATION))
    levels = len(family.DIFFICULTIES)
    return Task(
        tokenizer=tokenizer,
        model_config=model_config,
        params=params,
        source=source,
        reward=Reward(functools.partial(reward_fn, eos_id=eos), jittable=True),
        cluster_ids=functools.partial(cluster_ids, spec.run.eb_clusters, levels=levels),
        num_clusters=num_clusters(spec.run.eb_clusters, family),
        stop_ids=eos,
        evaluate=make_evaluator(spec.eval, model_config, sets, eos, mesh),
        base_source=sft.base_source(spec, model_config, len(train_problems), sft.data_key(family)),
        base_sha256=digest,
    )


def build(spec: TaskSpec, *, mesh=None, log=print) -> Task:
    """The synthetic tasks: char tokenizer, preset init (+ SFT warm start), exact-answer reward."""
    tok = tasks.CharTokenizer()
    return build_synthetic(spec, tasks, tok, tasks.reward_fn, mesh=mesh, log=log)
