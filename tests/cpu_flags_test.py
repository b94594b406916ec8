"""The XLA:CPU flags ebpo_jax sets on import."""

from ebpo_jax.runtime import cpu_flags

FLAG = "--xla_cpu_experimental_ynn_fusion_type=dot"


def test_flags_only_for_measured_jaxlib_versions():
    assert cpu_flags.cpu_flags("0.10.2") == (FLAG,)
    assert cpu_flags.cpu_flags("0.11.0") == ()
    assert cpu_flags.cpu_flags("0.1.0") == ()


def test_add_cpu_flags_appends_and_respects_the_user(monkeypatch):
    monkeypatch.setattr(cpu_flags.importlib.metadata, "version", lambda _: "0.10.2")
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    cpu_flags.add_cpu_flags(env)
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {FLAG}"
    cpu_flags.add_cpu_flags(env)  # idempotent
    assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1
    mine = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise"}
    cpu_flags.add_cpu_flags(mine)
    assert mine["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise"
    empty = {}
    cpu_flags.add_cpu_flags(empty)
    assert empty["XLA_FLAGS"] == FLAG
    opted_out = {cpu_flags.OPT_OUT: "0"}
    cpu_flags.add_cpu_flags(opted_out)
    assert "XLA_FLAGS" not in opted_out
    monkeypatch.setattr(cpu_flags.importlib.metadata, "version", lambda _: "0.11.0")
    newer = {}
    cpu_flags.add_cpu_flags(newer)
    assert "XLA_FLAGS" not in newer
