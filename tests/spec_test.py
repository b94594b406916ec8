"""The run spec and the orchestration's shape: frozen slices, a task family added in one place,
the AOT path lowering the loop's own programs, no import cycles, no import-time side effects."""

import ast
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import micro
from ebpo_jax import models, tasks
from ebpo_jax.pods import aot
from ebpo_jax.schema import ConfigError
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.families import arithmetic as task_arithmetic
from ebpo_jax.tasks.protocol import Reward, Task, build_task, families
from ebpo_jax.trainer import loop, register
from ebpo_jax.trainer.runners import make_runner

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _micro(**overrides):
    c = micro.get_config()
    c.unlock()
    c.update_from_flattened_dict(overrides)
    return c


def test_resolve_gives_frozen_slices_and_names_bad_fields():
    spec = resolve(_micro(**{"loss.num_minibatches": 2, "dapo.dynamic_sampling": True}))
    assert spec.update.updates == 2 and spec.optim.updates_per_step == 2
    assert spec.rollout.rounds == 3 and spec.task.batch_prompts == 3 * spec.rollout.prompts
    assert spec.task.family == "arithmetic"
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.update.loss.clip_low = 0.0
    with pytest.raises(ConfigError, match="loss.agg='nope'"):
        resolve(_micro(**{"loss.agg": "nope"}))
    with pytest.raises(ConfigError, match=r"sampler.mesh='data=1' needs steps_per_jit=1"):
        resolve(_micro(**{"sampler.mesh": "data=1", "steps_per_jit": 2}))
    dp = {"sampler.mesh": "data=2,tp=4", "sampler.dp_attention": True, "mesh.shape": (-1,)}
    with pytest.raises(ConfigError, match=r"^sampler.mesh='data=2,tp=4': tp=4 does not divide"):
        resolve(_micro(**dp), num_devices=8)  # micro's 1 kv head
    dp |= {"model.overrides.num_heads": 4, "model.overrides.num_kv_heads": 4}
    dp |= {"prompts_per_step": 4, "group_size": 2}
    resolve(_micro(**dp), num_devices=8)  # 8 rows per call over 2 x 4 chips
    with pytest.raises(ConfigError, match=r"sampler.dp_attention: the 2 x 2 rows .* 8 data x tp"):
        resolve(_micro(**dp, **{"sampler.prompts_per_call": 2}), num_devices=8)
    with pytest.raises(ConfigError, match=r"sampler.slots=4 .* 8 row shards and 2 data shards"):
        resolve(_micro(**dp, **{"sampler.slots": 4}), num_devices=8)


def _walk(x, path="spec"):
    """(path, value) of every dataclass field and container entry under x."""
    yield path, x
    if dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from _walk(getattr(x, f.name), f"{path}.{f.name}")
    elif isinstance(x, tuple | list):
        for i, v in enumerate(x):
            yield from _walk(v, f"{path}[{i}]")
    elif isinstance(x, Mapping):
        for k, v in x.items():
            yield from _walk(v, f"{path}[{k!r}]")


def test_a_spec_holds_no_configdict_and_hashes(monkeypatch):
    import ml_collections

    from ebpo_jax import advantages

    def custom(rewards, mask=None, my_option=1, forgetting=None):
        return advantages.grpo_advantage(rewards, mask=mask)

    # A custom estimator with its own option (removed from the registry after the test).
    monkeypatch.setitem(advantages._REGISTRY.entries, "grpo_with_option", custom)

    c = _micro(**{"model.lora.rank": 4, "estimator_options.forgetting": 0.9})
    c.estimator = "grpo_with_option"
    c.unlock()
    c.estimator_options.my_option = 3  # a custom estimator's option, added by a config file
    c.model.overrides.num_layers = 1
    spec = resolve(c)
    bad = [p for p, v in _walk(spec) if isinstance(v, ml_collections.ConfigDict | dict)]
    assert bad == []
    for part in (spec.rollout, spec.update, spec.optim, spec.mesh, spec.task, spec.eval):
        hash(part)  # static jit arguments
    assert spec.update.estimator_options.as_kwargs()["my_option"] == 3
    assert resolve(c).update == spec.update


def test_unknown_task_family_is_a_config_error():
    with pytest.raises(ConfigError, match=r"task.family='nope' is not one of \("):
        build_task(dataclasses.replace(resolve(_micro()).task, family="nope"))
    assert {"arithmetic", "math"} <= set(families())


def test_a_new_task_family_is_one_builder_and_a_registry_entry(tmp_path):
    """A copy task (answer = the prompt's digits) trains through the whole loop."""

    @register("copy")
    def build(spec, *, mesh=None, log=print):
        tok = tasks.CharTokenizer()
        problems = [
            tasks.Problem(f"{i}=", str(i), topic="copy", topic_id=0, difficulty=1, id=str(i))
            for i in range(20)
        ]
        mc = models.get_config("tiny", vocab_size=tok.vocab_size, **spec.model.overrides)
        return Task(
            tokenizer=tok,
            model_config=mc,
            params=models.init_params(mc, jax.random.key(spec.run.seed)),
            source=tasks.PromptSource(problems, tok, spec.batch_prompts, seed=spec.run.seed),
            reward=Reward(lambda *a: tasks.reward_fn(*a, eos_id=tok.eos_id), jittable=True),
            cluster_ids=lambda b: jnp.zeros(b.prompt_tokens.shape[:1], jnp.int32),
            num_clusters=1,
            stop_ids=tok.eos_id,
            evaluate=None,
        )

    c = _micro(workdir=str(tmp_path), total_steps=2, **{"mesh.devices": 1})
    c.task.family = "copy"
    s = loop.train(c, log=lambda *_: None)
    assert s["step"] == 2 and np.isnan(s["pass@1_end"])


def test_a_callers_reward_replaces_the_familys():
    """train(reward_fn=... / host_reward=...) hands its reward to build_task."""
    family = Reward(lambda *a: "family", jittable=True)

    @register("reward_test")
    def build(spec, *, mesh=None, log=print):
        return Task(*[None] * 4, family, *[None] * 4)

    spec = dataclasses.replace(resolve(_micro()).task, family="reward_test")
    try:
        assert build_task(spec).reward is family
        host = loop._caller_reward(None, lambda ro: ro)
        assert build_task(spec, reward=host).reward is host and not host.jittable
        assert loop._caller_reward(lambda *a: a, None).jittable
        assert loop._caller_reward(None, None) is None
    finally:
        tasks.protocol._REGISTRY.entries.pop("reward_test")


def test_aot_lowers_the_update_the_loop_runs():
    """aot.py compiles the loop's own runner.update with the loop's shardings (same HLO)."""
    c = _micro(**{"mesh.shape": (2, 4), "mesh.axes": ("data", "fsdp"), "prompts_per_step": 8})
    spec = resolve(c, 8)
    mc = aot.model_config_of(spec)
    mesh = loop.make_mesh(spec.mesh)
    params = models.init_params(mc, jax.random.key(0))
    task = aot.shape_task(spec, mc, params)
    view = loop.policy_lib.of(spec, task.model_config)
    state, sh, optimizer = loop._init_state(spec, view, task, mesh)
    step, abstract_state, abstract_ro = aot.make_step(spec, mc, mesh, prompt_len=8)
    ro = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_ro)
    ro = jax.device_put(ro, sh.rollout)  # as the loop places a rollout
    ran = _program(make_runner(spec, task, optimizer, sh, view).update, mesh, state, ro)
    assert _program(step.update, mesh, abstract_state, abstract_ro) == ran


def _program(jitted, mesh, *args):
    """(jaxpr, the lowered entry point's signature with its argument/result shardings), up to
    the numbering of shared sub-jaxprs (`_where3`), which depends on what was traced before."""
    with jax.set_mesh(mesh):
        jaxpr = str(jitted.trace(*args).jaxpr)
        text = jitted.lower(*args).as_text()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    return re.sub(r"\b(_[A-Za-z_]+?)\d+\b", r"\1", jaxpr), main


def test_arithmetic_family_clusters():
    batch = tasks.PromptBatch(*([np.array([0, 2])] * 7))._replace(difficulty=np.array([1, 2]))
    levels = len(tasks.DIFFICULTIES)
    assert task_arithmetic.cluster_ids("cell", batch).tolist() == [0, 2 * levels + 1]
    assert task_arithmetic.cluster_ids("topic", batch).tolist() == [0, 2]
    assert task_arithmetic.num_clusters("cell") == len(tasks.TOPICS) * levels


def test_import_sets_no_xla_flags():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    code = "import ebpo_jax, ebpo_jax.trainer.loop, os; print(os.environ.get('XLA_FLAGS'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "None"


def _imports(path: pathlib.Path, module: str) -> set[str]:
    """ebpo_jax modules `module` imports anywhere in its file (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("ebpo_jax")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ebpo_jax"):
            for a in node.names:  # `from ebpo_jax import losses` names a module
                sub = f"{node.module}.{a.name}"
                out.add(sub if _module_path(sub) else node.module)
    out.discard(module)
    return out


def _module_path(name: str) -> pathlib.Path | None:
    base = ROOT / name.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.exists():
            return p
    return None


def test_no_import_cycles_in_the_package():
    """Imports run one way, lazy (in-function) imports included; a package's __init__ that
    re-exports its own submodules is not a cycle."""
    graph = {}
    for path in (ROOT / "ebpo_jax").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        graph[name] = {m for m in _imports(path, name) if not name.startswith(m + ".")}
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
