"""DAPO's dynamic sampling scored on the host (trainer/refill.py): the jittable path's choices,
its metrics, a math-records run, and a kill -9 during a refill round that resumes bit for bit."""

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from train_math_test import _config as math_config
from train_math_test import _rows, files  # noqa: F401  (a fixture)

from configs import micro
from ebpo_jax import models, sharding, tasks
from ebpo_jax.config import ConfigError, validate
from ebpo_jax.rollout.refill import HostRefill
from ebpo_jax.rollout.single_turn import make_rollout_fn, make_round_fn
from ebpo_jax.runtime.checkpoint import load_params
from ebpo_jax.runtime.metrics import read_metrics
from ebpo_jax.spec import resolve
from ebpo_jax.tasks.families import arithmetic as task_arithmetic
from ebpo_jax.tasks.protocol import model_config_from
from ebpo_jax.trainer import loop
from ebpo_jax.trainer.shardings import rollout_shardings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
P, G, ROUNDS = 4, 4, 3


def third(tokens_BN):
    """[B] 1.0 where the first token is a multiple of 3: ~21% of groups of 4 all-equal."""
    return (tokens_BN[:, 0] % 3 == 0).astype(np.float32)


@pytest.fixture(scope="module")
def arith():
    c = micro.get_config()
    c.unlock()
    c.prompts_per_step, c.group_size = P, G
    c.dapo.dynamic_sampling, c.dapo.max_extra_rounds = True, ROUNDS - 1
    spec = resolve(c)
    tok, train, _ = task_arithmetic.load_problems(spec.task)
    mc = model_config_from(spec.task.model, tok.vocab_size)
    params = models.init_params(mc, jax.random.key(0))
    source = tasks.PromptSource(train, tok, P * ROUNDS, seed=1)
    batch = jax.tree.map(jnp.asarray, source.next_batch())
    clusters = lambda b: task_arithmetic.cluster_ids(c.eb_clusters, b)
    return spec.rollout, mc, params, batch, clusters


def _host_refill(arith, reward, key):
    """The host path: round programs, `reward` on host arrays, HostRefill's loop."""
    spec, mc, params, batch, clusters = arith
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sh = SimpleNamespace(
        rollout=rollout_shardings(sharding.rows_sharding(mesh, P)),
        replicated=NamedSharding(mesh, PartitionSpec()),
    )
    one_round = jax.jit(make_round_fn(spec, mc, tasks.EOS_ID, clusters))
    rounds = []

    def next_round(r):
        ro = one_round(params, batch, jnp.int32(r), key)
        tokens = np.asarray(ro.tokens).reshape(P * G, -1)
        rounds.append(ro._replace(rewards=jnp.asarray(reward(tokens).reshape(P, G))))
        return rounds[-1]

    refill = HostRefill(spec, sh)
    return refill(next_round), refill.last_metrics, rounds


def third_jnp(tokens_BN, *_):
    return (tokens_BN[:, 0] % 3 == 0).astype(jnp.float32)


def zeros(tokens_BN, *_):
    return jnp.zeros(tokens_BN.shape[:1], jnp.float32)


def _same(ro) -> np.ndarray:
    r_PG = np.asarray(ro.rewards)
    return (r_PG == r_PG[:, :1]).all(-1)


@pytest.mark.parametrize(
    "host,jitted",
    [
        (third, third_jnp),
        # Nothing spreads: every round runs (~20 s loaded).
        pytest.param(lambda t: np.asarray(zeros(t)), zeros, marks=pytest.mark.slow),
    ],
)
def test_host_refill_makes_the_jittable_paths_choices(arith, host, jitted):
    spec, mc, params, batch, clusters = arith
    key = jax.random.key(4)
    want = jax.jit(make_rollout_fn(spec, mc, jitted, tasks.EOS_ID, clusters))(params, batch, key)
    got, metrics, rounds = _host_refill(arith, host, key)
    for name in ("index", "tokens", "lengths", "rewards", "group_valid", "generated_tokens"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert float(got.all_same_frac) == float(want.all_same_frac)

    # Brute force: round by round, the spread groups in order; stop once P spread, keep P.
    spread, dropped, used = [], 0, 0
    for ro in rounds:
        if len(spread) >= P:
            break
        used += 1
        dropped += int(_same(ro).sum())
        spread += np.asarray(ro.index)[~_same(ro)].tolist()
    kept = spread[:P]
    assert len(rounds) == used
    assert np.asarray(got.index)[np.asarray(got.group_valid)].tolist() == kept
    lengths = np.asarray(got.lengths)[np.asarray(got.group_valid)]
    generated = sum(int(np.asarray(ro.lengths).sum()) for ro in rounds)
    assert metrics == pytest.approx(
        {
            "dapo/rounds": used,
            "dapo/kept_groups": len(kept),
            "dapo/dropped_groups": dropped,
            "dapo/unfilled_groups": P - len(kept),
            "dapo/generated_per_kept": generated / lengths.sum() if kept else np.nan,
        },
        nan_ok=True,
    )
    if host is third:  # the case under test really drops and refills
        assert dropped > 0 and used > 1 and len(kept) == P
    else:  # nothing spreads: every round runs, nothing is kept
        assert used == ROUNDS and not kept


def test_host_dynamic_sampling_is_accepted_but_not_at_staleness_1(files, tmp_path):  # noqa: F811
    c = math_config(files, tmp_path, **{"dapo.dynamic_sampling": True})
    validate(c, jax.device_count())
    c = math_config(
        files,
        tmp_path,
        **{
            "dapo.dynamic_sampling": True,
            "rollout.max_staleness": 1,
            "sampler.mesh": "data=4",
            "mesh.devices": 4,
        },
    )
    with pytest.raises(ConfigError, match="refill rounds need max_staleness=0") as e:
        validate(c, jax.device_count())
    assert "\n" not in str(e.value)


def _dapo_math(files, workdir):  # noqa: F811
    return math_config(
        files,
        workdir,
        **{
            "dapo.dynamic_sampling": True,
            "data.reward": "refill_reward:odd_words",  # math-verify would never pay here
            "data.reward_timeout_s": 600.0,  # a loaded machine must not turn rewards into 0s
            "data.eval_path": "",
            "total_steps": 3,
            "checkpoint_every": 1,
        },
    )


# Kills itself (SIGKILL: no handler, no cleanup) at the first refill round after step 1,
# once step 1's checkpoint has committed (orbax saves in the background).
_KILLER = """
import os, runpy, signal, sys, time
from ebpo_jax.runtime.checkpoint import list_steps
from ebpo_jax.rollout import refill
call, seen = refill.HostRefill.__call__, []
def killing(self, next_round):
    def rounds(r):
        if r >= 1 and seen:
            t0 = time.monotonic()
            while not list_steps(os.environ["CHECKPOINTS"]) and time.monotonic() - t0 < 120:
                time.sleep(0.1)
            os.kill(os.getpid(), signal.SIGKILL)
        return next_round(r)
    out = call(self, rounds)
    seen.append(1)
    return out
refill.HostRefill.__call__ = killing
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("experiments/train.py", run_name="__main__")
"""


@pytest.mark.slow  # ~3 min loaded: a run in-process, one killed in a subprocess, its resume
def test_math_dapo_run_resumes_bitwise_after_kill_9_mid_refill(files, tmp_path):  # noqa: F811
    full = _dapo_math(files, tmp_path / "full")
    loop.train(full, log=lambda *_: None)
    rows = read_metrics(str(tmp_path / "full"))[1:]
    assert sum(r["dapo/dropped_groups"] for r in rows) > 0
    assert max(r["dapo/rounds"] for r in rows) > 1
    _check_refill_rows(rows)

    killed = _dapo_math(files, tmp_path / "killed")
    config_file = tmp_path / "dapo_math.py"  # the CLI reads the test's config from a file
    config_file.write_text(
        "from refill_test import _dapo_math\n"
        f"def get_config():\n    return _dapo_math({files!r}, {str(tmp_path / 'killed')!r})\n"
    )
    flags = [f"--config={config_file}"]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
        JAX_PLATFORMS="cpu",
        JAX_DEFAULT_MATMUL_PRECISION="highest",  # as conftest sets it in this process
        CHECKPOINTS=str(tmp_path / "killed" / "checkpoints"),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _KILLER, *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    s = loop.train(killed, log=lambda *_: None)
    assert s["step"] == 3 and s["resumed_from"] == 1  # killed in step 2's refill
    assert _rows(tmp_path / "full") == _rows(tmp_path / "killed")
    a, b = (load_params(str(tmp_path / n)) for n in ("full", "killed"))
    jax.tree.map(np.testing.assert_array_equal, a, b)


def _check_refill_rows(rows):
    """Each step's groups are kept, dropped or left unfilled, as the update saw them."""
    for r in rows:
        assert r["dapo/kept_groups"] + r["dapo/unfilled_groups"] == P
        assert r["dapo/dropped_groups"] == pytest.approx(
            r["adv/all_same_group_frac"] * r["dapo/rounds"] * P
        )
        assert r["train/valid_group_frac"] == r["dapo/kept_groups"] / P


@pytest.mark.slow  # ~1.5 min loaded: a multi-turn run compiling its turn programs and update
def test_multiturn_episodes_refill_on_the_host(tmp_path):
    from multiturn_train_test import _config as guess_config

    c = guess_config(tmp_path)
    c.dapo.dynamic_sampling, c.total_steps = True, 2
    loop.train(c, log=lambda *_: None)
    rows = read_metrics(str(tmp_path))[1:]
    assert [r["step"] for r in rows] == [1, 2]
    _check_refill_rows(rows)
    assert all(r["episode/turns_mean"] >= 1 for r in rows)
