"""Supervised warm start on the synthetic tasks, cached on disk after the first run, and
content-addressed: `params_digest` names a warm start by the SHA-256 of its bytes, `export`
writes it as `<digest>.npz`, and `sft.params_file` starts a run from such a file (SFT's
float rounding differs across CPU families, so only a shared file gives every machine
the same start). With `sft.export_dir` set (a grid's warm_starts/), `sft_<key>.sha256` there
names the file each cache key made, so a grid resumed on another machine starts its runs
from the committed warm starts instead of training its own."""

import dataclasses
import hashlib
import io
import json
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ebpo_jax import losses, models, tasks
from ebpo_jax.runtime import storage
from ebpo_jax.spec import TaskSpec

# sft fields that do not change what SFT trains (the seed enters as init_seed).
_NOT_IN_KEY = ("seed", "params_file", "params_sha256", "export_dir")
_HEX = frozenset("0123456789abcdef")


def _task_key(task) -> dict:
    """The task section as it keyed caches before `task.family` existed (same cache files)."""
    d = dataclasses.asdict(task)
    if not d.get("family"):
        d.pop("family", None)
    d.pop("val_per_cell", None)  # validation problems are never trained on
    d.pop("difficulty_file", None)  # estimated from the warm start, not SFT's input
    d.pop("difficulty_samples", None)
    if "order" in d:  # the RL order: every order shares the naive runs' file
        d["order"] = "naive"
    return d


def sft_loss(model_config, params, tokens_BT, loss_mask_BT):
    """Mean next-token cross-entropy over the answer + EOS tokens."""
    logits_BTV = models.forward(model_config, params, tokens_BT[:, :-1])
    logp_BT = losses.token_logprobs(logits_BTV, tokens_BT[:, 1:])
    mask_BT = loss_mask_BT[:, 1:]
    return -jnp.sum(jnp.where(mask_BT, logp_BT, 0.0)) / jnp.maximum(mask_BT.sum(), 1)


def make_sft_step(model_config, optimizer):
    """(params, opt_state, tokens, mask) -> (params, opt_state, loss), to be jitted."""

    def step(params, opt_state, tokens_BT, mask_BT):
        loss, grads = jax.value_and_grad(lambda p: sft_loss(model_config, p, tokens_BT, mask_BT))(
            params
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def cache_path(spec: TaskSpec, model_config, num_problems: int, data_key: str = "") -> str:
    """Where the warm-start params for this (model, SFT settings, data, seed) are cached;
    `data_key` names a family's SFT targets where the task section does not."""
    parts = [
        repr(model_config),
        # The seed enters as init_seed below: sft.seed = -1 and = the run's seed share a file.
        {k: v for k, v in dataclasses.asdict(spec.sft).items() if k not in _NOT_IN_KEY},
        _task_key(spec.task),
        init_seed(spec),
        num_problems,
    ]
    if data_key:  # appended only when set: every other family keeps its cache files
        parts.append(data_key)
    key = json.dumps(parts, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = spec.sft.cache_dir or os.path.join(spec.run.workdir, "sft_cache")
    return os.path.join(root, f"sft_{digest}.npz")


def _save(path, params):
    buf = io.BytesIO()
    np.savez(buf, *[np.asarray(x) for x in jax.tree.leaves(params)])
    storage.write_bytes(path, buf.getvalue())  # atomic: never a half-written cache


def _load(path, like):
    with np.load(io.BytesIO(storage.read_bytes(path))) as f:
        leaves = [f[f"arr_{i}"] for i in range(len(f.files))]
    treedef = jax.tree.structure(like)
    if len(leaves) != treedef.num_leaves:
        raise ValueError(
            f"SFT cache {path} has {len(leaves)} arrays, expected {treedef.num_leaves}"
        )
    return jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])


def data_key(family) -> str:
    """A family's name for its SFT targets beyond the task section ("" for most)."""
    return getattr(family, "SFT_DATA_KEY", "")


def init_seed(spec: TaskSpec) -> int:
    """The initial policy's seed (init and SFT batches): `sft.seed`, or the run's when -1."""
    seed = spec.sft.seed
    return spec.run.seed if seed < 0 else seed


def base_source(spec: TaskSpec, model_config, num_problems: int, data_key: str = "") -> str:
    """What the initial policy is: the SFT cache file, or the seeded init when SFT is off."""
    if spec.sft.steps == 0:
        return f"init(seed={init_seed(spec)})"
    return cache_path(spec, model_config, num_problems, data_key)


def params_digest(params) -> str:
    """SHA-256 over the leaves' dtype, shape and bytes in tree order: a warm start's identity."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def export(params, folder: str) -> str:
    """Write `params` to `<folder>/<digest>.npz` (compressed; kept if present); its path."""
    path = os.path.join(folder, f"{params_digest(params)}.npz")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        # A writer's own temporary file: a grid's runs of one warm start may export at once.
        tmp = f"{path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.npz"
        np.savez_compressed(tmp, *[np.asarray(x) for x in jax.tree.leaves(params)])
        os.replace(tmp, path)
    return path


def load_file(path: str, like):
    """A committed warm start; a file named by a digest must hash to it."""
    if not storage.exists(path):
        raise FileNotFoundError(f"sft.params_file={path!r}: no such file")
    params = _load(path, like)
    stem = os.path.basename(path).removesuffix(".npz")
    if len(stem) == 64 and set(stem) <= _HEX and params_digest(params) != stem:
        raise ValueError(f"sft.params_file={path!r}: its params hash to {params_digest(params)}")
    return params


def check_digest(spec: TaskSpec, params) -> str:
    """The warm start's digest (exported to `sft.export_dir` when set); ValueError when
    `sft.params_sha256` names another one."""
    digest = params_digest(params)
    if spec.sft.export_dir:
        export(params, spec.sft.export_dir)
    want = spec.sft.params_sha256
    if want and digest != want:
        raise ValueError(
            f"sft.params_sha256={want}: this warm start hashes to {digest} (SFT on another "
            "CPU family or code rounds differently; start from the committed sft.params_file)"
        )
    return digest


def warm_start(
    spec: TaskSpec, model_config, params, problems, tokenizer, *, family=tasks, log=print
):
    """Params after `spec.sft.steps` supervised steps on `problems` (loaded if cached), or
    the committed `sft.params_file`; the examples are `family.sft_examples`'s (the loss mask
    is the family's), keyed by its `SFT_DATA_KEY` when it has one."""
    if spec.sft.params_file:
        log(f"SFT warm start: committed params {spec.sft.params_file}")
        return load_file(spec.sft.params_file, params)
    if spec.sft.steps == 0:
        return params
    path = cache_path(spec, model_config, len(problems), data_key(family))
    committed = committed_warm_start(spec, path)
    if committed:
        log(f"SFT warm start: the committed params {committed}")
        return load_file(committed, params)
    if storage.exists(path):
        log(f"SFT warm start: loaded cached params from {path}")
        params = _load(path, params)
    else:
        params = _train(spec, model_config, params, problems, tokenizer, family, log)
        _save(path, params)
        log(f"SFT warm start: cached params at {path}")
    return _commit(spec, path, params) if spec.sft.export_dir else params


def _train(spec: TaskSpec, model_config, params, problems, tokenizer, family, log):
    """`spec.sft.steps` supervised steps from `params`."""
    sft = spec.sft
    schedule = optax.warmup_cosine_decay_schedule(
        0.0,
        sft.learning_rate,
        sft.warmup_steps,
        max(sft.steps, sft.warmup_steps + 1),
        0.1 * sft.learning_rate,
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01)
    )
    step = jax.jit(make_sft_step(model_config, optimizer), donate_argnums=(0, 1))
    examples = getattr(family, "sft_examples", tasks.sft_examples)(problems, tokenizer)
    rng = np.random.default_rng(init_seed(spec))
    opt_state = optimizer.init(params)
    params = jax.tree.map(jnp.copy, params)  # the caller's params are donated otherwise
    loss = float("nan")
    for i in range(sft.steps):
        idx = rng.integers(0, len(problems), sft.batch_size)
        params, opt_state, loss = step(
            params, opt_state, examples.tokens[idx], examples.loss_mask[idx]
        )
        if (i + 1) % max(1, sft.steps // 5) == 0:
            log(f"SFT step {i + 1}/{sft.steps}: loss {float(loss):.4f}")
    return params


def _pointer(export_dir: str, path: str) -> str:
    """`<export_dir>/sft_<key>.sha256`: which exported warm start the cache key `path` made."""
    return os.path.join(export_dir, os.path.basename(path).removesuffix(".npz") + ".sha256")


def _commit(spec: TaskSpec, path: str, params):
    """Export `params` and name it from its cache key, so another machine loads this file
    instead of training its own SFT (which rounds differently on another CPU family); the
    params the name points at (another process's, when it named the key first)."""
    digest = params_digest(params)
    if spec.sft.params_sha256 and digest != spec.sft.params_sha256:
        return params  # check_digest refuses it: never name a refused warm start
    export(params, spec.sft.export_dir)
    pointer = _pointer(spec.sft.export_dir, path)  # local: config checks refuse gs://
    tmp = f"{pointer}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    with open(tmp, "w") as f:
        f.write(digest + "\n")
    try:
        os.link(tmp, pointer)  # atomic and exclusive: the first process to name the key wins
    except FileExistsError:
        pass
    finally:
        os.remove(tmp)
    named = committed_warm_start(spec, path)
    return params if os.path.basename(named) == f"{digest}.npz" else load_file(named, params)


def committed_warm_start(spec: TaskSpec, path: str) -> str:
    """The exported warm start an earlier run recorded for cache key `path` under
    `sft.export_dir` ("" when none): a grid's runs on any machine start from that file."""
    if not spec.sft.export_dir:
        return ""
    pointer = _pointer(spec.sft.export_dir, path)
    if not storage.exists(pointer):
        return ""
    digest = storage.read_text(pointer).strip()
    file = os.path.join(spec.sft.export_dir, f"{digest}.npz")
    if not storage.exists(file):
        raise FileNotFoundError(f"{pointer} names warm start {digest}, but {file} is missing")
    return file
