"""The AOT memo (pods/aot_memo.py): a program compiled once for a TPU topology is reused, with
the same report, by a byte-identical program; a changed shape or loss compiles again."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from configs import tiny
from ebpo_jax.pods import aot, aot_report
from ebpo_jax.pods.aot_memo import MEMORY_FIELDS, Memo, MemoizedOutOfMemory

pytestmark = pytest.mark.skipif(
    aot_report.libtpu_available() is not None, reason="no TPU compiler here"
)
TOPOLOGY = "v5e-4"
ALL = ["train update", "reshard weights", "sampler prefill", "sampler decode"]


def _run(memo, prompt_len=16, programs="all", **overrides):
    """(name -> report dict, name -> memo key) of tiny on a 2x2 v5e through `memo`."""
    c = tiny.get_config()
    c.unlock()
    c.mesh.shape, c.mesh.axes = (2, 2), ("fsdp", "tp")
    c.model.overrides.vocab_size = 256
    c.loss.kl_coef = 0.001
    c.sampler.mesh = "data=4"
    c.update_from_flattened_dict(overrides)
    spec = aot.resolve_for(c, TOPOLOGY, sampler_mesh=c.sampler.mesh)
    with jax.default_matmul_precision("default"):  # as experiments/aot_compile.py runs
        reports, _ = aot.run(
            spec, TOPOLOGY, aot.Workload(prompt_len), programs=programs, memo=memo, log=lambda *_: 0
        )
    return {r.name: r.as_dict() for r in reports}


def _lowered(rows: int, scale: float):
    """A sharded program on the v5e 2x2's devices, lowered: (lowered, mesh)."""
    _, _, devices = aot_report.topology_devices(TOPOLOGY)
    mesh = Mesh(np.array(devices).reshape(4), ("data",))
    x = jax.ShapeDtypeStruct((rows, 256), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    f = jax.jit(lambda a: jnp.tanh(scale * a @ a.T).sum(0))
    return f.lower(x), mesh


def test_a_program_compiles_once_and_a_changed_one_again(tmp_path):
    first, again = Memo(str(tmp_path), TOPOLOGY, "first"), Memo(str(tmp_path), TOPOLOGY, "again")
    lowered, mesh = _lowered(512, 2.0)
    real = lowered.compile()
    a = first.compile(lowered, mesh)
    b = again.compile(_lowered(512, 2.0)[0], mesh)
    assert (a.how, b.how, a.key) == ("compiled", "reused from first", b.key)
    ma = real.memory_analysis()
    for m in (a.memory_analysis(), b.memory_analysis()):
        assert [getattr(m, f) for f in MEMORY_FIELDS] == [getattr(ma, f) for f in MEMORY_FIELDS]
        assert m.argument_size_in_bytes == 512 * 256 * 4 // 4  # a quarter of x on each chip
    assert b.cost_analysis() == a.cost_analysis() and a.cost_analysis()["flops"] > 0
    assert b.output_shardings == jax.tree.leaves(real.output_shardings)
    for changed in (_lowered(1024, 2.0), _lowered(512, 3.0)):  # a shape; a constant
        c = again.compile(*changed)
        assert c.how == "compiled" and c.key != a.key
    assert len(list(tmp_path.glob("*.json"))) == 3


def test_a_program_that_did_not_fit_is_reported_again_without_compiling(tmp_path):
    """The memo stores the compiler's out-of-memory result; a reuse raises it again."""
    lowered, mesh = _lowered(512, 2.0)
    memo = Memo(str(tmp_path), TOPOLOGY, "first")
    key = memo.compile(lowered, mesh).key
    memo._write(key, {"error": "RESOURCE_EXHAUSTED: 99 GiB", "outputs": [], "first": "x"})
    with pytest.raises(MemoizedOutOfMemory, match="RESOURCE_EXHAUSTED: 99 GiB") as e:
        memo.compile(lowered, mesh)
    assert aot_report.is_resource_exhausted(e.value)


def _without_memo_fields(report: dict) -> dict:
    return {k: v for k, v in report.items() if k not in ("memo", "memo_key")}


@pytest.mark.slow  # 136 s on the loaded 2-core host
def test_a_runs_identical_programs_compile_once_and_changed_ones_compile_again(tmp_path):
    memo = Memo(str(tmp_path), TOPOLOGY, "first")
    first = _run(memo)
    assert list(first) == ALL and {r["memo"] for r in first.values()} == {"compiled"}
    assert len(list(tmp_path.glob("*.json"))) == 4

    again = _run(Memo(str(tmp_path), TOPOLOGY, "again"))
    for name in ALL:  # the decode traces with the prefill's outputs rebuilt from the memo
        assert again[name]["memo"] == "reused from first", name
        assert again[name]["memo_key"] == first[name]["memo_key"]
        assert _without_memo_fields(again[name]) == _without_memo_fields(first[name])

    # A loss constant changes the update alone; the sampler's programs stay byte-identical.
    kl = _run(Memo(str(tmp_path), TOPOLOGY, "kl"), **{"loss.kl_coef": 0.002})
    assert kl["train update"]["memo"] == "compiled"
    assert kl["train update"]["memo_key"] != first["train update"]["memo_key"]
    assert {kl[n]["memo"] for n in ALL[1:]} == {"reused from first"}

    wider = _run(Memo(str(tmp_path), TOPOLOGY, "wider"), prompt_len=32, programs="update")
    assert wider["train update"]["memo"] == "compiled"
    assert len(list(tmp_path.glob("*.json"))) == 6
