"""The SFT warm start's cache key: which runs share one warm start, and which committed file a
grid's runs start from on another machine."""

import glob
import os
import shutil

import jax
import pytest

from configs import micro, tiny
from ebpo_jax import config as config_lib
from ebpo_jax import models
from ebpo_jax.spec import resolve
from ebpo_jax.tasks import calc, reasoning, sft
from ebpo_jax.tasks.families import arithmetic
from ebpo_jax.tasks.protocol import model_config_from


def _path(seed, sft_seed):
    c = tiny.get_config()
    c.unlock()
    c.seed, c.sft.seed = seed, sft_seed
    spec = resolve(c, 1).task
    return sft.cache_path(spec, models.get_config("tiny"), 100), sft.init_seed(spec)


def test_a_fixed_sft_seed_shares_one_warm_start_across_run_seeds():
    assert _path(1, 0) == _path(2, 0) == _path(0, -1)  # -1 = the run's seed: seed 0's file
    assert _path(1, -1) != _path(2, -1)
    assert _path(1, 0)[0] != _path(1, 1)[0]
    assert _path(3, -1)[1] == 3 and _path(3, 5)[1] == 5


def test_bad_sft_seed_is_a_one_line_error():
    c = tiny.get_config()
    c.unlock()
    c.sft.seed = -2
    with pytest.raises(config_lib.ConfigError, match="sft.seed"):
        config_lib.validate(c)


def test_a_family_data_key_names_its_own_warm_start():
    c = tiny.get_config()
    spec, model = resolve(c, 1).task, models.get_config("tiny")
    plain = sft.cache_path(spec, model, 100)
    assert sft.cache_path(spec, model, 100, sft.data_key(object())) == plain  # no key: same file
    assert sft.cache_path(spec, model, 100, calc.SFT_DATA_KEY) != plain
    assert calc.SFT_DATA_KEY != sft.data_key(reasoning) == ""


def _warm_start(tmp_path, logs):
    """The warm start of two SFT steps of configs/micro with a grid's export folder."""
    c = micro.get_config()
    c.unlock()
    c.sft.steps, c.sft.cache_dir = 2, str(tmp_path / "cache")
    c.sft.export_dir = str(tmp_path / "warm")
    spec = resolve(c, 1).task
    tok, train, _ = arithmetic.load_problems(spec)
    mc = model_config_from(spec.model, tok.vocab_size)
    init = models.init_params(mc, jax.random.key(sft.init_seed(spec)))
    return sft.warm_start(spec, mc, init, train, tok, log=logs.append)


def test_a_grid_resumed_on_another_machine_starts_from_its_committed_warm_start(tmp_path):
    """The first machine's SFT is exported and named by its cache key; a machine without
    that SFT cache loads the file the name points at instead of training its own."""
    logs = []
    params = _warm_start(tmp_path, logs)
    assert any("SFT step 2/2" in line for line in logs)
    pointers = glob.glob(str(tmp_path / "warm" / "sft_*.sha256"))
    assert len(pointers) == 1 and os.path.exists(tmp_path / "cache" / (
        os.path.basename(pointers[0]).removesuffix(".sha256") + ".npz"))  # fmt: skip
    assert open(pointers[0]).read().strip() == sft.params_digest(params)
    # Another machine: no SFT cache, and (to tell the two apart) the name points at another
    # committed file, as a run on another CPU family would have left it.
    shutil.rmtree(tmp_path / "cache")
    other = jax.tree.map(lambda x: x + 1.0, params)
    with open(pointers[0], "w") as f:
        f.write(os.path.basename(sft.export(other, str(tmp_path / "warm"))).removesuffix(".npz"))
    logs.clear()
    again = _warm_start(tmp_path, logs)
    assert not any("SFT step" in line for line in logs)
    assert sft.params_digest(again) == sft.params_digest(other)
    assert not os.path.exists(tmp_path / "cache")
    os.remove(tmp_path / "warm" / f"{sft.params_digest(other)}.npz")
    with pytest.raises(FileNotFoundError, match=r"sft_\w+\.sha256 names warm start \w+, but"):
        _warm_start(tmp_path, logs)


def test_a_warm_start_is_named_once_and_never_when_refused(tmp_path):
    """Two processes naming one key: the second gets the first's file. A warm start that
    sft.params_sha256 refuses is never named."""
    params = _warm_start(tmp_path, [])
    c = micro.get_config()
    c.unlock()
    c.sft.steps, c.sft.cache_dir = 2, str(tmp_path / "cache")
    c.sft.export_dir = str(tmp_path / "warm")
    spec = resolve(c, 1).task
    (pointer,) = glob.glob(str(tmp_path / "warm" / "sft_*.sha256"))
    path = str(tmp_path / "cache" / os.path.basename(pointer).replace(".sha256", ".npz"))
    late = jax.tree.map(lambda x: x * 2.0, params)  # a process that trained after the first
    got = sft._commit(spec, path, late)
    assert sft.params_digest(got) == sft.params_digest(params) == open(pointer).read().strip()
    os.remove(pointer)
    c.sft.params_sha256 = "f" * 64
    refused = resolve(c, 1).task
    assert sft._commit(refused, path, late) is late and not os.path.exists(pointer)
    assert glob.glob(str(tmp_path / "warm" / "*.tmp")) == []
