"""Config validation (issue 22): each impossible value is one ConfigError naming its field,
before anything compiles; the CLI prints it as one `error:` line with exit status 2."""

import glob
import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

from ebpo_jax import config as C
from ebpo_jax import schema
from ebpo_jax.config import ConfigError, validate
from ebpo_jax.config import checks as spec_checks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = os.path.join(ROOT, "configs", "micro.py")


def _micro(**changes):
    from configs import micro

    c = micro.get_config()
    for key, value in changes.items():
        node = c
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return c


BAD = [
    ("optimizer.clip_norm", -1.0, "optimizer.clip_norm must be > 0"),
    ("optimizer.clip_norm", 0.0, "optimizer.clip_norm must be > 0"),
    ("optimizer.b1", 1.0, r"optimizer.b1 must be in \[0, 1\)"),
    ("optimizer.b2", 1.5, r"optimizer.b2 must be in \[0, 1\)"),
    ("optimizer.warmup_steps", -5, "optimizer.warmup_steps must be >= 0"),
    ("optimizer.final_lr_frac", -3.0, r"optimizer.final_lr_frac must be in \[0, 1\]"),
    ("optimizer.weight_decay", -0.1, "optimizer.weight_decay must be >= 0"),
    ("log_every", 0, "log_every must be >= 1"),
    ("eval_batch_size", 0, "eval_batch_size must be >= 1"),
    ("seed", -1, "seed must be an int >= 0"),
    ("task.train_per_cell", 0, "task.train_per_cell must be >= 1"),
    ("task.test_per_cell", 0, "task.test_per_cell must be >= 1"),
    ("workdir", "", "workdir must be a non-empty path"),
    ("workdir", "  ", "workdir must be a non-empty path"),
    ("sampler.top_k", -5, "sampler.top_k must be an int >= 0"),
    ("sampler.page_size", 0, "sampler.page_size must be an int >= 1, got 0"),
    ("sampler.kv_pages", -1, "sampler.kv_pages must be an int >= 0 .*, got -1"),
    ("sampler.live_buckets", 0, "sampler.live_buckets must be an int >= 1, got 0"),
    ("sampler.attention", "triton", r"sampler.attention='triton' is not one of"),
    ("loss.kl_estimator", "k9", r"loss.kl_estimator='k9' is not one of"),
    ("sampler.max_new_tokens", 40, r"sampler.max_new_tokens=40: .* the model has 32"),
    ("log_samples_every", -1, "log_samples_every must be >= 0"),
    ("wandb.mode", "cloud", r"wandb.mode='cloud' is not one of"),
    ("sft.batch_size", 0, "sft.batch_size must be >= 1"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD, ids=[f for f, _, _ in BAD])
def test_bad_value_is_one_line_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message) as err:
        validate(_micro(**{field: value}))
    assert "\n" not in str(err.value)


def test_defaults_and_shipped_configs_validate():
    validate(_micro())
    from configs import tiny

    validate(tiny.get_config())


def test_max_positions_from_the_hf_config_and_overrides(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"max_position_embeddings": 64}')
    c = C.default_config()
    c.model.hf_path = str(ckpt)
    assert spec_checks.model_max_positions(schema.parse(c)) == 64
    c.model.overrides.max_position_embeddings = 48  # applied over the checkpoint's
    assert spec_checks.model_max_positions(schema.parse(c)) == 48
    with pytest.raises(
        ConfigError, match="prompts of 60 tokens .* need 76 positions, the model has 63"
    ):
        spec_checks.check_positions(c.sampler.max_new_tokens, 60, 63)
    spec_checks.check_positions(c.sampler.max_new_tokens, 48, 64)


def test_estimator_options_are_checked_against_the_estimator():
    c = _micro(**{"estimator_options.forgetting": 0.95, "estimator_options.per_batch": True})
    validate(c)
    c.estimator = "grpo"
    with pytest.raises(ConfigError, match="estimator_options.forgetting=0.95: estimator 'grpo'"):
        validate(c)


def test_estimator_options_none_means_the_estimators_default():
    import jax.numpy as jnp

    from ebpo_jax import advantages

    r = jnp.array([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    state = advantages.init_eb_state(1)
    opts = dict(C.default_config().estimator_options)
    assert set(opts) == set(C.ESTIMATOR_OPTIONS) and all(v is None for v in opts.values())
    a, _, _ = advantages.estimate("ebpo", r, state, **opts)
    b, _, _ = advantages.estimate("ebpo", r, state)
    assert jnp.array_equal(a, b)
    a, _, _ = advantages.estimate("grpo", r, state, **opts)  # grpo takes none of them


def _train(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "experiments", "train.py"), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (  # misspelt, no --config (parsed while the flag is defined)
            ["--config.optimizer.clip_nrm=1"],
            "error: unknown config field 'config.optimizer.clip_nrm' (Did you mean \"clip_norm\"",
        ),
        (  # misspelt with --config (parsed by absl), and an impossible value
            [f"--config={MICRO}", "--config.optimizer.clip_norm=-1"],
            "error: optimizer.clip_norm must be > 0, got -1.0",
        ),
        pytest.param(
            [f"--config={MICRO}", "--config.gruop_size=2"],
            "error: unknown config field 'config.gruop_size'",
            marks=pytest.mark.slow,  # each CLI run: ~5 s idle, 12-30 s on a loaded 2-core CPU
        ),
        pytest.param(
            [f"--config={MICRO}", "--config.seed=abc"],
            "error: flag --config.seed=abc",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # settable from the command line (the value reaches validate)
            [
                f"--config={MICRO}",
                "--config.estimator_options.forgetting=0.95",
                "--config.estimator=grpo",
            ],
            "error: estimator_options.forgetting=0.95: estimator 'grpo' takes no option",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_cli_prints_one_line_and_exits_2(args, message):
    out = _train(*args)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), out.stderr[-2000:]


_CONFIG_FILES = sorted(
    glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "*.py"))
    + glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "gpu", "*.py"))
)


@pytest.mark.parametrize("path", _CONFIG_FILES, ids=os.path.basename)
def test_every_shipped_config_validates(path):
    """Each run config in configs/ and configs/gpu/ (its `:aot` variant where it has one)."""
    module_spec = importlib.util.spec_from_file_location("shipped_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    takes_variant = bool(inspect.signature(module.get_config).parameters)
    config = module.get_config("aot") if takes_variant else module.get_config()
    validate(config)


def test_every_shipped_config_writes_under_runs():
    """One default run folder: ./runs/<name> (relative to where the command runs)."""
    for path in _CONFIG_FILES:
        module_spec = importlib.util.spec_from_file_location("shipped_config", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        workdir = module.get_config().workdir
        assert workdir.startswith("runs/"), f"{os.path.relpath(path)}: workdir {workdir}"
    assert C.default_config().workdir.startswith("runs/")


def test_gpu_sampler_settings_reach_the_sampler_spec():
    """The 8xH200 config's pool, calls and attention are what a sampler call is given."""
    from ebpo_jax.rollout.single_turn import sampler_spec_of
    from ebpo_jax.spec import resolve

    path = os.path.join(os.path.dirname(__file__), "..", "configs", "gpu", "qwen3_8b_h200.py")
    module_spec = importlib.util.spec_from_file_location("h200_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    rollout = resolve(module.get_config("aot"), 8).rollout
    s = sampler_spec_of(rollout, 1)
    assert (s.attention, s.kv_pages, s.page_size, s.slots) == ("xla", 36864, 128, 0)
    assert rollout.prompts_per_call == 256


def test_every_schema_field_has_a_doc_and_the_defaults_round_trip():
    """Each setting is declared once with a doc; default_config() parses back to the schema's
    defaults, and its JSON is what config.json holds."""
    import dataclasses

    def fields(cls):
        for f in dataclasses.fields(cls):
            sub = f.metadata.get("section")
            yield f
            if sub is not None:
                yield from fields(sub)

    undocumented = [f.name for f in fields(schema.Config) if not f.metadata.get("doc", "").strip()]
    assert undocumented == []
    typed = schema.parse(C.default_config())
    assert typed == schema.Config() and hash(typed) == hash(schema.Config())
    from ebpo_jax.spec import resolve

    assert resolve(_micro()).config_json == _micro().to_json(indent=2)


def test_custom_estimator_options_and_model_overrides_are_typed_and_hashable():
    c = _micro()
    c.unlock()
    c.estimator_options.my_option = 3
    c.model.overrides.num_layers = 1
    typed = schema.parse(c)
    assert typed.estimator_options.as_kwargs()["my_option"] == 3
    assert typed.estimator_options.as_kwargs()["forgetting"] is None
    assert typed.model.overrides["num_layers"] == 1 and "num_layers" in dict(typed.model.overrides)
    hash(typed)
    c.model.overrides.num_layerz = 1
    with pytest.raises(
        ConfigError, match=r"model.overrides: unknown ModelConfig field\(s\) \['num_layerz'\]"
    ):
        validate(c)


def test_shipped_configs_load_without_the_repo_on_the_path(tmp_path):
    """experiments/train.py loads a config by path with only experiments/ on sys.path: a
    config that imports `configs.x` as a package fails there (use config.load_sibling)."""
    script = tmp_path / "load_all.py"
    script.write_text(
        "import importlib.util, sys\n"
        "for path in sys.argv[1:]:\n"
        "    spec = importlib.util.spec_from_file_location('cfg', path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    paths = [os.path.abspath(p) for p in _CONFIG_FILES]
    out = subprocess.run(
        [sys.executable, str(script), *paths], cwd=tmp_path, env=env, capture_output=True,
        text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
