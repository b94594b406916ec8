"""Helpers shared by test files."""

import os
from collections.abc import Sequence


def save_tiny_tokenizer(path, extra_words: Sequence[str] = ()) -> str:
    """A word-level tokenizer with BOS post-processing and a chat template, saved to `path`;
    `extra_words` join the vocabulary after the default words."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
        "<|user|>",
        "<|system|>",
        "<|assistant|>",
        "<|end|>",
    ]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    corpus = ["what is one plus two", "solve for x", "the answer is", "Answer: $Answer 3 5"] * 2
    corpus += [" ".join(extra_words)] if extra_words else []
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=specials[4:],
    )
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(path)
    return str(path)


def micro_config(workdir, **fields):
    """configs/micro.py on one device with `workdir` and dotted `fields` overridden."""
    from configs import micro

    c = micro.get_config()
    c.unlock()
    c.workdir, c.mesh.devices = str(workdir), 1
    c.update_from_flattened_dict(fields)
    return c


def flip_a_byte(step_dir) -> str:
    """Flip one bit in the middle of a checkpoint step's biggest array file; returns its path."""
    state = os.path.join(step_dir, "state")
    files = [os.path.join(r, f) for r, _, fs in os.walk(state) for f in fs]
    path = max(files, key=os.path.getsize)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x01]))
    return path


def forward_cached(
    config, params, tokens, positions, cache, *, start, kv_mask_BS=None, kv_len_B=None, **kw
):
    """models.forward_cached with its CacheSlots as keywords (so jit can keep `start` static)."""
    from ebpo_jax import models

    slots = models.CacheSlots(start, positions, kv_mask_BS, kv_len_B)
    return models.forward_cached(config, params, tokens, cache, slots, **kw)


def compile_tiny_decode(mesh, attention: str, dp_attention: bool = False):
    """The engine's decode compiled on a (data, tp) `mesh` for a tiny model with 8 kv heads
    and a pool of 8192 pages of 16 tokens: (compiled decode, the pool's bytes per chip)."""
    import jax

    from ebpo_jax import models
    from ebpo_jax.pods import aot
    from ebpo_jax.sampler import SamplerSpec, Sampling
    from ebpo_jax.sharding import param_shardings

    mc = models.get_config("tiny", head_dim=128, num_kv_heads=8, num_heads=16, dtype="bfloat16")
    params = models.abstract_params(mc)
    params = aot.abstract(params, param_shardings(mc, params, mesh))
    spec = SamplerSpec(
        max_new_tokens=64, num_samples=2, eos_ids=(1,), sampling=Sampling(), page_size=16,
        kv_pages=8192, attention=attention, dp_attention=dp_attention,
    )  # fmt: skip
    with jax.default_matmul_precision("default"):
        programs = aot.compile_sampler(spec, mc, mesh, params, 8, 32)
    plan = programs["plan"]
    return programs["decode"][2], plan.pages * aot.page_bytes_per_chip(mc, 16, tp=aot.pool_tp(mesh, spec))


def start_trainers(workdir, *flags, processes: int = 2, wrap=None) -> list:
    """experiments/train.py (micro) as `processes` processes of one run (4 CPU devices each,
    gloo); `wrap(i, cmd)` may prefix process i's command. Popens, output in stdout."""
    import socket
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    procs = []
    for i in range(processes):
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",  # CPU cross-process collectives
            JAX_COORDINATOR_ADDRESS=addr,
            JAX_NUM_PROCESSES=str(processes),
            JAX_PROCESS_ID=str(i),
        )
        cmd = [
            sys.executable,
            os.path.join(root, "experiments", "train.py"),
            "--config=configs/micro.py",
            f"--config.workdir={workdir}",
            "--config.mesh.shape=(-1,)",
            *flags,
        ]
        cmd = wrap(i, cmd) if wrap is not None else cmd
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, **out))
    return procs
