"""HF interop: logit parity with transformers (torch CPU f32), to_hf round trip, clear errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from ebpo_jax import models

FORWARD = jax.jit(models.forward, static_argnums=0)
COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def _hf_model(kind):
    if kind == "llama":
        scaling = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        config = transformers.LlamaConfig(
            **COMMON,
            head_dim=16,
            rope_theta=10000.0,
            rope_scaling=scaling,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        )
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3Config(
            **COMMON, head_dim=32, rope_theta=1000.0, rms_norm_eps=1e-6, tie_word_embeddings=True
        )
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # norms too, so a wrong norm is visible
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def _torch_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens))).logits.float().numpy()


TOKENS = np.random.default_rng(0).integers(0, 128, (2, 40))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    """A tiny random HF checkpoint (Qwen3 saved sharded with an index) and its torch logits."""
    model = _hf_model(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    shard = "20KB" if request.param == "qwen3" else "1GB"
    model.save_pretrained(path, max_shard_size=shard)
    sharded = os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert sharded == (request.param == "qwen3")
    return request.param, path, _torch_logits(model, TOKENS)


def test_logit_parity_with_transformers(checkpoint):
    kind, path, ref = checkpoint
    config, params = models.from_hf(path, dtype="float32")
    assert config.model_type == kind
    assert config.tie_word_embeddings == (kind == "qwen3")
    assert config.qk_norm == (kind == "qwen3")
    if kind == "llama":
        assert config.rope_scaling_dict["rope_type"] == "llama3"
    else:
        assert config.head_dim * config.num_heads != config.hidden_size
    logits = np.asarray(FORWARD(config, params, jnp.asarray(TOKENS)))
    err = np.abs(logits - ref).max()
    print(f"{kind} max |logit diff| vs transformers: {err:.2e}")
    assert err <= 1e-4, err
    assert np.abs(ref).max() > 1.0  # logits are not trivially small


@pytest.mark.parametrize("max_shard_bytes", [5 * 2**30, 30_000])
def test_to_hf_round_trip_reloads_in_transformers(checkpoint, tmp_path, max_shard_bytes):
    _kind, path, ref = checkpoint
    config, params = models.from_hf(path, dtype="float32")
    models.to_hf(config, params, str(tmp_path), max_shard_bytes=max_shard_bytes)
    index = os.path.exists(tmp_path / "model.safetensors.index.json")
    assert index == (max_shard_bytes < 2**20)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    np.testing.assert_array_equal(_torch_logits(reloaded.eval(), TOKENS), ref)
    config2, params2 = models.from_hf(str(tmp_path))
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_old_style_rope_config_is_read(checkpoint):
    _kind, path, _ = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    new = models.hf.config_from_hf_dict(hf)
    rope = dict(hf.pop("rope_parameters"))
    hf["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] == "llama3":
        rope["type"] = rope.pop("rope_type")  # the oldest spelling
        hf["rope_scaling"] = rope
    assert models.hf.config_from_hf_dict(hf) == new


def _copy(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
            g.write(f.read())
    return dst


def test_bad_checkpoints_are_clear_errors(tmp_path):
    model = _hf_model("llama")
    good = str(tmp_path / "good")
    model.save_pretrained(good)
    file = os.path.join(good, "model.safetensors")

    with pytest.raises(FileNotFoundError, match="config.json"):
        models.from_hf(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="can't be honoured"):
        models.from_hf(good, dtype="int8")

    bad = _copy(good, str(tmp_path / "mistral"))
    with open(os.path.join(bad, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump({**hf, "model_type": "mistral"}, f)
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        models.from_hf(bad)

    name = "model.layers.1.mlp.up_proj.weight"
    for case, change in [
        ("shape", lambda t: {**t, name: t[name][:-1]}),
        ("dtype", lambda t: {**t, name: t[name].astype(np.int8)}),
        ("missing", lambda t: {k: v for k, v in t.items() if k != name}),
        ("unexpected", lambda t: {**t, name.replace("weight", "bias"): t[name][:, 0]}),
    ]:
        bad = _copy(good, str(tmp_path / case))
        save_file(change(load_file(file)), os.path.join(bad, "model.safetensors"))
        culprit = name.replace("weight", "bias") if case == "unexpected" else name
        with pytest.raises((ValueError, KeyError), match=culprit.replace(".", r"\.")) as err:
            models.from_hf(bad)
        assert case in str(err.value) or case == "missing"

    bad = str(tmp_path / "no_weights")
    os.makedirs(bad)
    _copy(good, bad)
    os.remove(os.path.join(bad, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        models.from_hf(bad)


def _convert_module():
    from conftest import load_experiment

    return load_experiment("convert_hf")  # once per process: its absl flags are defined once


@pytest.mark.parametrize("fmt", ["npz", "orbax"])
def test_convert_hf_script_both_ways(checkpoint, tmp_path, fmt):
    _, path, ref = checkpoint
    convert = _convert_module().convert
    mid = str(tmp_path / ("params.npz" if fmt == "npz" else "params_orbax"))
    convert(path, mid)
    back = str(tmp_path / "hf_again")
    convert(mid, back, max_shard_gb=1e-5, tokenizer_from=path)
    assert os.path.exists(os.path.join(back, "model.safetensors.index.json"))
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(back, "config.json")) as g:
        src, out = json.load(f), json.load(g)
    assert all(out.get(k) == src.get(k) for k in ("bos_token_id", "eos_token_id"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)
    np.testing.assert_array_equal(_torch_logits(reloaded.eval(), TOKENS), ref)


def test_convert_hf_command_line(checkpoint, tmp_path):
    import subprocess
    import sys

    kind, path, _ = checkpoint
    if kind != "llama":
        pytest.skip("one command-line run is enough")
    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "convert_hf.py")
    dst = str(tmp_path / "p.npz")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, script, f"--src={path}", f"--dst={dst}", "--dtype=bfloat16"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    config, params = _convert_module().load_params(dst)
    assert config.param_dtype == "bfloat16"
    assert params["layers"]["attn"]["q"][...].dtype == jnp.bfloat16
    _, ref = models.from_hf(path, dtype="bfloat16")
    jax.tree.map(np.testing.assert_array_equal, params, ref)


def test_convert_hf_names_a_missing_or_unusable_src(tmp_path):
    import subprocess
    import sys

    from absl import app

    script = os.path.join(os.path.dirname(__file__), "..", "experiments", "convert_hf.py")
    missing, dst = str(tmp_path / "no_such_ckpt"), str(tmp_path / "p.npz")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, script, f"--src={missing}", f"--dst={dst}"],
        check=False, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines() == [f"error: --src={missing}: no such file or folder"]
    check = _convert_module().check_inputs
    with pytest.raises(app.UsageError, match=f"--src={tmp_path}: neither an HF checkpoint"):
        check(str(tmp_path))  # a folder without config.json or model_config.json
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(app.UsageError, match="weights.bin: a file, but not .npz"):
        check(str(tmp_path / "weights.bin"))
    with pytest.raises(app.UsageError, match=f"--tokenizer_from={missing}: no such"):
        check(str(tmp_path / "weights.bin"), tokenizer_from=missing)


def test_from_hf_onto_a_mesh(checkpoint):
    from jax.sharding import PartitionSpec as P

    from ebpo_jax import sharding

    _, path, _ = checkpoint
    mesh = sharding.make_mesh([("fsdp", 4), ("tp", 2)])
    _, params = models.from_hf(path, dtype="float32", mesh=mesh)
    q = params["layers"]["attn"]["q"][...]
    assert q.sharding.spec == P(None, "fsdp", "tp", None)
    _, ref = models.from_hf(path, dtype="float32")
    jax.tree.map(np.testing.assert_array_equal, params, ref)


def test_load_tokenizer_from_checkpoint_folder(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(tmp_path))
    loaded = models.load_tokenizer(str(tmp_path))
    assert loaded("hello world")["input_ids"] == [2, 3]
    assert loaded.eos_token_id == 1
    with pytest.raises(FileNotFoundError, match="nowhere"):
        models.load_tokenizer(str(tmp_path / "nowhere"))
