"""The one registry helper: lazy built-ins, marks, one-line errors; every registry uses it."""

import pytest

from ebpo_jax import advantages, losses
from ebpo_jax.runtime.registry import Registry
from ebpo_jax.schema import ConfigError
from ebpo_jax.tasks import envs, protocol


def _registry():
    return Registry(
        lambda name, known: KeyError(f"unknown thing {name!r}; known: {', '.join(known)}"),
        builtin={"path": "os.path:join"},
    )


def test_a_builtin_is_imported_on_first_get_and_listed_before():
    import os.path

    reg = _registry()
    assert reg.names() == ("path",) and reg.entries == {}
    assert reg.get("path") is os.path.join and reg.entries == {"path": os.path.join}


def test_marks_follow_the_last_registration():
    reg = _registry()
    f = reg.register("f", "stateful")(len)
    assert f is len and reg.marked("f", "stateful") and not reg.marked("f", "draws")
    reg.add("f", len)
    assert not reg.marked("f", "stateful") and not reg.marked("nope", "stateful")


def test_an_unknown_name_raises_the_owners_error_naming_the_known_ones():
    reg = _registry()
    reg.add("zeta", len)
    with pytest.raises(KeyError, match=r"unknown thing 'x'; known: path, zeta"):
        reg.get("x")


def test_every_registry_is_one_and_keeps_its_error():
    for module in (advantages, losses, protocol, envs):
        assert isinstance(module._REGISTRY, Registry), module.__name__
    with pytest.raises(KeyError, match=r"unknown advantage estimator 'x'; known: dr_grpo, ebpo"):
        advantages.get("x")
    with pytest.raises(KeyError, match=r"unknown policy loss 'x'; known: cispo, clip_cov"):
        losses.get("x")
    with pytest.raises(ConfigError, match=r"task.family='x' is not one of \('arithmetic', "):
        protocol.get("x")
    with pytest.raises(ConfigError, match=r"environment 'x' is not one of \('calculator', "):
        envs.get("x")
    assert losses.draws("clip_cov") and not losses.draws("kl_cov")
    assert advantages._REGISTRY.marked("ebpo", "stateful")
