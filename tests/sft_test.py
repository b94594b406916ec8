"""The SFT warm start's cache key: which runs share one warm start."""

import pytest

from configs import tiny
from ebpo_jax import config as config_lib
from ebpo_jax import models
from ebpo_jax.spec import resolve
from ebpo_jax.tasks import calc, reasoning, sft


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
