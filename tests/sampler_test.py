"""generate: HF greedy parity, exact log-probs, stops, shared prefill, sharding, and the paged
engine (slots, small pages, a short pool) row for row against the static batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ebpo_jax import models, sampler, sharding
from ebpo_jax.sampler import engine, selection

CONFIG = models.get_config("tiny")
# Mixed lengths, right-padded with junk ids that must not matter.
PROMPTS = np.array(
    [
        [5, 6, 7, 8, 9, 10],
        [11, 12, 13, 77, 77, 77],
        [14, 15, 16, 17, 18, 77],
        [19, 77, 77, 77, 77, 77],
    ],
    np.int32,
)
LENGTHS = np.array([6, 3, 5, 1], np.int32)


@pytest.fixture(scope="module")
def params():
    # Larger-than-default weights so logits are far from uniform (clear argmax margins).
    p = models.init_params(CONFIG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, p)


N = 6  # new tokens; one value keeps the number of compiles down


@jax.jit
def _forward_logp(params, seq_BT):
    return jax.nn.log_softmax(models.forward(CONFIG, params, seq_BT), -1)


def reference(params, tokens, prompts, lengths, num_samples=1):
    """(log-probs of tokens, greedy argmax) from one models.forward on prompt + completion."""
    tokens = np.asarray(tokens)
    rows, n = tokens.shape
    prompt_rows = np.repeat(np.arange(len(prompts)), num_samples)
    seq = np.zeros((rows, prompts.shape[1] + n), np.int32)
    for r, b in enumerate(prompt_rows):
        seq[r, : lengths[b]] = prompts[b, : lengths[b]]
        seq[r, lengths[b] : lengths[b] + n] = tokens[r]
    logp_BTV = np.asarray(_forward_logp(params, jnp.asarray(seq)))
    # Causal attention: the zeros after each sequence do not change what precedes them.
    at_BN = lengths[prompt_rows][:, None] - 1 + np.arange(n)[None]
    logp_BNV = np.take_along_axis(logp_BTV, at_BN[..., None], axis=1)
    return np.take_along_axis(logp_BNV, tokens[..., None], -1)[..., 0], logp_BNV.argmax(-1)


def check_against_forward(params, gen, prompts, lengths, num_samples=1, atol=1e-4):
    """Each row's log-probs agree with a full forward pass; padding is 0."""
    tokens, logprobs, gen_len = map(np.asarray, gen[:3])
    real = np.arange(tokens.shape[1])[None] < gen_len[:, None]
    assert np.all((gen_len >= 1) & (gen_len <= tokens.shape[1]))
    np.testing.assert_array_equal(tokens[~real], 0)
    np.testing.assert_array_equal(logprobs[~real], 0.0)
    ref, _ = reference(params, tokens, prompts, lengths, num_samples)
    np.testing.assert_allclose(logprobs[real], ref[real], rtol=0, atol=atol)


HF_COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def hf_checkpoint(request, tmp_path_factory):
    """A tiny random HF model with far-from-uniform logits, and our (config, params) of it."""
    if request.param == "llama":
        hf_config = transformers.LlamaConfig(**HF_COMMON, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    else:
        hf_config = transformers.Qwen3Config(**HF_COMMON, tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15) if p.ndim > 1 else p.copy_(1.0 + 0.2 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    return model, *models.from_hf(path, dtype="float32")


def hf_greedy(model, prompt_BT, n):
    """transformers greedy completions (after the prompt), EOS 2 then pad 0, width n."""
    ids = torch.as_tensor(np.asarray(prompt_BT, np.int64))
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
    completion = out[:, ids.shape[1] :].numpy()
    return np.pad(completion, ((0, 0), (0, n - completion.shape[1])))


def run(params, prompts=PROMPTS, lengths=LENGTHS, *, rng=None, mesh=None, stats=False, **kw):
    """generate with a SamplerSpec of `kw` (temperature/top_k/top_p go into its Sampling)."""
    s = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p") if k in kw}
    spec = sampler.SamplerSpec(**({"max_new_tokens": N} | kw), sampling=sampler.Sampling(**s))
    rng = jax.random.key(0) if rng is None else rng
    gen = sampler.generate(CONFIG, params, prompts, lengths, spec, rng=rng, mesh=mesh)
    return (gen, gen.stats) if stats else gen


def greedy(params, prompts=PROMPTS, lengths=LENGTHS, **kw):
    return run(params, prompts, lengths, temperature=0.0, **kw)


def test_greedy_matches_transformers(hf_checkpoint):
    model, config, params = hf_checkpoint
    n = 8
    rng = np.random.default_rng(1)
    spec = sampler.SamplerSpec(n, eos_ids=(2,), sampling=sampler.Sampling(0.0), page_size=4)
    key = jax.random.key(0)
    # Equal lengths: one batched HF call.
    equal = rng.integers(3, 128, (3, 7)).astype(np.int32)
    ours = sampler.generate(config, params, equal, np.full(3, 7), spec, rng=key)
    np.testing.assert_array_equal(ours.tokens, hf_greedy(model, equal, n))
    # Mixed lengths: right-padded for us, each prompt alone (unpadded) for HF.
    lengths = np.array([7, 2, 5, 4])
    mixed = np.where(np.arange(7)[None] < lengths[:, None], rng.integers(3, 128, (4, 7)), 9)
    ours = sampler.generate(config, params, mixed.astype(np.int32), lengths, spec, rng=key)
    for b, length in enumerate(lengths):
        want = hf_greedy(model, mixed[b : b + 1, :length], n)[0]
        np.testing.assert_array_equal(ours.tokens[b], want)
        stop = np.flatnonzero(want == 2)
        assert ours.lengths[b] == (stop[0] + 1 if stop.size else n)


def test_logprobs_match_forward_when_sampling(params):
    gen = run(params, rng=jax.random.key(3), temperature=0.8, top_k=20, top_p=0.9, num_samples=2)
    assert gen.tokens.shape == (8, N) and gen.tokens.dtype == jnp.int32
    assert gen.logprobs.dtype == jnp.float32 and gen.lengths.shape == (8,)
    np.testing.assert_array_equal(gen.lengths, N)
    check_against_forward(params, gen, PROMPTS, LENGTHS, num_samples=2)


def test_greedy_is_argmax_of_forward(params):
    gen = greedy(params)
    _, argmax = reference(params, gen.tokens, PROMPTS, LENGTHS)
    np.testing.assert_array_equal(gen.tokens, argmax)
    # Rows do not depend on their neighbours, the padding width or the (even invalid) pad ids.
    alone = greedy(params, np.array([[11, 12, 13, -1]], np.int32), LENGTHS[1:2])
    np.testing.assert_array_equal(alone.tokens[0], gen.tokens[1])


def test_eos_stops_rows_and_pads(params):
    tokens = np.asarray(greedy(params).tokens)
    # Stop ids: row 0's third token and row 2's first; the other rows may hit them too.
    eos = (int(tokens[0, 2]), int(tokens[2, 0]))
    gen = greedy(params, eos_ids=eos)
    for r in range(len(PROMPTS)):
        hits = np.flatnonzero(np.isin(tokens[r], eos))
        want = hits[0] + 1 if hits.size else N
        assert gen.lengths[r] == want
        np.testing.assert_array_equal(gen.tokens[r, :want], tokens[r, :want])
    assert gen.lengths[0] <= 3 and gen.lengths[2] == 1
    check_against_forward(params, gen, PROMPTS, LENGTHS)


def test_early_stop_when_all_rows_finish(params):
    tokens = np.asarray(greedy(params).tokens)
    eos = tuple(sorted(set(tokens[:, 1].tolist())))
    gen, stats = greedy(params, eos_ids=eos, stats=True)
    assert int(gen.lengths.max()) <= 2
    # The loop ran only as long as some row was still going.
    assert int(stats.steps) == int(gen.lengths.max()) - 1 < N
    np.testing.assert_array_equal(gen.tokens[:, 2:], 0)


def test_shared_prefill_equals_repeated_prompts(params):
    kw = {"rng": jax.random.key(7), "temperature": 1.0, "top_p": 0.95, "page_size": 2}
    shared = run(params, num_samples=3, **kw)
    plain = run(params, np.repeat(PROMPTS, 3, 0), np.repeat(LENGTHS, 3), **kw)
    np.testing.assert_array_equal(shared.tokens, plain.tokens)
    np.testing.assert_array_equal(shared.lengths, plain.lengths)
    np.testing.assert_allclose(shared.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    # Samples of one prompt differ from each other.
    assert len({tuple(row) for row in np.asarray(shared.tokens[:3])}) == 3


@pytest.mark.parametrize("layout", ["separate_mesh", "training_mesh"])
def test_sharded_equals_unsharded(params, layout):
    kw = {"rng": jax.random.key(5), "temperature": 1.0, "num_samples": 2, "eos_ids": (3,)}
    ref = run(jax.device_put(params, jax.devices()[0]), **kw)
    if layout == "separate_mesh":  # a sampling-only mesh: rows over 8 devices, params replicated
        mesh = sharding.make_mesh([("data", 8)])
        placed = jax.device_put(params, NamedSharding(mesh, P()))
    else:  # the trainer's mesh: FSDP + tensor-parallel params, rows over data x fsdp
        mesh = sharding.make_mesh([("data", 2), ("fsdp", 2), ("tp", 2)])
        placed = sharding.shard_params(None, params, mesh)
        assert not all(x.sharding.is_fully_replicated for x in jax.tree.leaves(placed))
    out = run(placed, mesh=mesh, **kw)
    assert len(out.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.lengths, ref.lengths)
    np.testing.assert_allclose(out.logprobs, ref.logprobs, rtol=0, atol=1e-5)


def test_generate_inside_jit(params):
    """The trainer calls generate on traced prompts and keys inside its own jit."""

    @jax.jit
    def rollout(params, prompts, lengths, rng):
        return greedy(params, prompts, lengths, rng=rng)

    out = rollout(params, PROMPTS, LENGTHS, jax.random.key(0))
    np.testing.assert_array_equal(out.tokens, greedy(params).tokens)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"prompt_lengths": np.array([6, 3, 7, 1])}, "prompt_lengths"),
        ({"prompt_lengths": np.array([6, 3, 0, 1])}, "prompt_lengths"),
        ({"prompt_lengths": np.array([6, 3, 5])}, "prompt_lengths"),
        ({"prompt_tokens": PROMPTS[0]}, "prompt_tokens"),
        ({"prompt_tokens": PROMPTS + 300}, "prompt_tokens"),
        ({"max_new_tokens": 510}, "max_position_embeddings"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"eos_ids": "x"}, "eos_id"),
        ({"num_samples": 0}, "num_samples"),
        ({"slots": -1}, "slots"),
        ({"page_size": 0}, "page_size"),
        ({"attention": "flash"}, "attention"),
        ({"live_buckets": 0}, "live_buckets"),
        # One row (6 prompt + 4 - 1 new tokens) needs 3 pages of 4: the pool must hold them.
        ({"page_size": 4, "kv_pages": 2}, r"kv_pages=2 gives 2 pages .* needs 3 pages"),
    ],
)
def test_bad_input_fails_before_compiling(params, monkeypatch, change, match):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(engine, "prefill_jit", no_compile)
    inputs = {k: change.pop(k) for k in ("prompt_tokens", "prompt_lengths") if k in change}
    inputs = {"prompts": PROMPTS, "lengths": LENGTHS} | {
        {"prompt_tokens": "prompts", "prompt_lengths": "lengths"}[k]: v for k, v in inputs.items()
    }
    with pytest.raises(ValueError, match=match):
        run(params, **inputs, **({"max_new_tokens": 4} | change))


def test_bucket_sizes_cover_every_live_count():
    assert engine.bucket_sizes(6, 4) == [2, 3, 5, 6]
    assert engine.bucket_sizes(3, 8) == [1, 2, 3]
    assert engine.bucket_sizes(5, 1) == [5]


def test_a_calls_programs_share_one_hashable_static_call():
    """Equal calls are equal static arguments (a program compiles once per shape); a live
    bucket's call differs from its call only in the plan's slots."""
    spec = sampler.SamplerSpec(max_new_tokens=N, num_samples=2, slots=4)
    first, again = (sampler.Session(CONFIG, spec).programs(4, 6) for _ in range(2))
    call = first["decode"].call
    assert {p.call for p in first.values()} == {call} and call.plan.slots == 4
    assert again["decode"].call == call and hash(again["decode"].call) == hash(call)
    bucket = call.with_slots(2)
    assert bucket.plan == call.plan._replace(slots=2) and bucket[:2] == call[:2]


def sampled_reference(params, gen, rng, prompts, lengths, num_samples, sampling):
    """Each row's tokens re-drawn from a full forward pass with fold_in(rng, row, token) keys."""
    tokens, gen_len = np.asarray(gen.tokens), np.asarray(gen.lengths)
    prompt_rows = np.repeat(np.arange(len(prompts)), num_samples)
    seq = np.zeros((len(tokens), prompts.shape[1] + tokens.shape[1]), np.int32)
    for r, b in enumerate(prompt_rows):
        seq[r, : lengths[b]] = prompts[b, : lengths[b]]
        seq[r, lengths[b] : lengths[b] + tokens.shape[1]] = tokens[r]
    logits_BTV = models.forward(CONFIG, params, jnp.asarray(seq))
    at_BN = lengths[prompt_rows][:, None] - 1 + np.arange(tokens.shape[1])[None]
    logits_BNV = jnp.take_along_axis(logits_BTV, jnp.asarray(at_BN)[..., None], axis=1)
    want = np.zeros_like(tokens)
    for t in range(tokens.shape[1]):
        keys = selection.row_keys(rng, jnp.arange(len(tokens)), t)
        want[:, t] = selection.select_tokens(keys, logits_BNV[:, t], **sampling._asdict())[0]
    real = np.arange(tokens.shape[1])[None] < gen_len[:, None]
    return np.where(real, want, 0)


# Paged engine layouts, each row for row equal to the static batch with its default pool:
# slots refilled (5 for 12 rows), pages of 1-4 tokens, pools too small for every slot
# (rows wait for pages and are preempted), page size not dividing the prompt width, steps
# on batch buckets of the live slots (2, 4 or 6 of 6).
PAGED = [
    pytest.param({"slots": 5, "page_size": 4}, marks=pytest.mark.slow),
    pytest.param({"page_size": 1, "kv_pages": 40}, marks=pytest.mark.slow),
    pytest.param({"slots": 6, "page_size": 3, "kv_pages": 7}, marks=pytest.mark.slow),
    {"slots": 6, "page_size": 3, "kv_pages": 7, "live_buckets": 3},
    pytest.param({"slots": 12, "page_size": 2, "kv_pages": 10}, marks=pytest.mark.slow),
]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(0.0, marks=pytest.mark.slow, id="greedy"),
        pytest.param(1.0, id="sampled"),
    ],
)
def static_run(request, params):
    """The static batch on PROMPTS x 3 samples, 12 new tokens, stop ids hit mid-row."""
    temperature = request.param
    kw = {"max_new_tokens": 12, "num_samples": 3, "rng": jax.random.key(5)}
    kw |= {"temperature": temperature, "top_k": 6 if temperature else 0}
    free = run(params, **kw)
    # Stop ids: tokens the free run draws at step 3 of rows 0 and 7, so rows end at mixed steps.
    kw["eos_ids"] = tuple(sorted({int(free.tokens[0, 3]), int(free.tokens[7, 3])}))
    gen, stats = run(params, stats=True, **kw)
    lengths = np.asarray(gen.lengths)
    assert lengths.min() < lengths.max() == 12, lengths
    assert int(stats.preempted) == 0 and int(stats.steps) == 11
    return kw, gen


def test_static_batch_draws_by_the_row_and_token_keys(params, static_run):
    kw, gen = static_run
    sampling = sampler.Sampling(kw["temperature"], kw["top_k"], 1.0)
    want = sampled_reference(params, gen, kw["rng"], PROMPTS, LENGTHS, 3, sampling)
    np.testing.assert_array_equal(gen.tokens, want)
    check_against_forward(params, gen, PROMPTS, LENGTHS, num_samples=3, atol=1e-5)


@pytest.mark.parametrize("layout", PAGED, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_paged_layouts_equal_the_static_batch_row_for_row(params, static_run, layout):
    kw, static = static_run
    gen, stats = run(params, stats=True, **kw, **layout)
    np.testing.assert_array_equal(gen.tokens, static.tokens)
    np.testing.assert_array_equal(gen.lengths, static.lengths)
    np.testing.assert_allclose(gen.logprobs, static.logprobs, rtol=0, atol=1e-5)
    assert int(stats.peak_pages) <= stats.pages
    computed, every = int(stats.computed), int(stats.steps) * stats.slots
    if "live_buckets" in layout:  # live rows only, in buckets: fewer than every slot
        assert int(stats.busy) <= computed < every
    else:
        assert computed == every
    if "kv_pages" in layout:  # the pool, not the slots, limits concurrency: rows waited
        assert int(stats.busy) < int(stats.steps) * stats.slots
    else:  # every slot-step that decoded a live row made one of the rows' tokens 1..len-1
        assert int(stats.busy) == int((np.asarray(static.lengths) - 1).sum())


def test_paged_sharded_equals_unsharded(params, static_run):
    """Rows, slots and pools over 2 data shards x 4-way tp, a short pool per shard."""
    kw, static = static_run
    mesh = sharding.make_mesh([("data", 2), ("tp", 4)])
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    layout = {"slots": 4, "page_size": 2, "kv_pages": 20}
    gen, stats = run(placed, mesh=mesh, stats=True, **kw, **layout)
    assert len(gen.tokens.sharding.device_set) == 8
    np.testing.assert_array_equal(gen.tokens, static.tokens)
    np.testing.assert_array_equal(gen.lengths, static.lengths)
    np.testing.assert_allclose(gen.logprobs, static.logprobs, rtol=0, atol=1e-5)
    assert stats.pages == 10 and stats.slots == 2
    assert int(stats.computed) == int(stats.steps) * 2 * stats.slots  # every slot, every step
    with pytest.raises(ValueError, match="data shards"):
        run(placed, mesh=mesh, **(kw | {"slots": 3}))


def test_dp_attention_sharded_equals_unsharded(params):
    """Attention data-parallel over tp (rows and pools over 4 data x 2 tp = 8 shards, every
    head on each chip, the weights still split over tp): the unsharded static batch's tokens."""
    prompts, lengths = np.concatenate([PROMPTS, PROMPTS[::-1]]), np.concatenate([LENGTHS] * 2)
    kw = {"max_new_tokens": 8, "num_samples": 2, "rng": jax.random.key(3), "top_k": 6}
    static = run(params, prompts, lengths, **kw)
    mesh = sharding.make_mesh([("data", 4), ("tp", 2)])
    placed = jax.device_put(params, sharding.param_shardings(CONFIG, params, mesh))
    layout = {"slots": 8, "page_size": 2, "kv_pages": 56, "dp_attention": True}
    gen, stats = run(placed, prompts, lengths, mesh=mesh, stats=True, **kw, **layout)
    np.testing.assert_array_equal(gen.tokens, static.tokens)
    np.testing.assert_array_equal(gen.lengths, static.lengths)
    np.testing.assert_allclose(gen.logprobs, static.logprobs, rtol=0, atol=1e-5)
    assert stats.pages == 7 and stats.slots == 1  # per (data, tp) shard


@pytest.mark.parametrize("serial", [False, True])
def test_prompt_copies_match_a_loop_over_pages(serial):
    """engine._copy_prompts, layer by layer (serial, as on TPU / GPU) or not, against numpy."""
    rng = np.random.default_rng(0)
    P_, Q, W, S, C2, D, C = 24, 3, 4, 2, 2, 3, 4
    pools = tuple(rng.normal(size=(P_, S, C2, D)).astype(np.float32) for _ in range(2))
    staged = tuple(rng.normal(size=(Q, W, S, C2, D)).astype(np.float32) for _ in range(2))
    targets = rng.permutation(P_)[: C * W + C]  # distinct pages: the copy order cannot matter
    shared_CW = targets[: C * W].reshape(C, W).copy()
    shared_CW[1] = P_  # candidate 1 shares pages already written: "none"
    own_C = targets[C * W :].copy()
    own_C[3] = P_  # candidate 3 not admitted
    prompt_C, partial_C = np.array([0, 2, 1, 2]), np.array([1, 3, 9, 0])  # 9: past the last page
    copy = engine.schedule.Copy(*map(jnp.asarray, (prompt_C, shared_CW, own_C, partial_C)))
    got = jax.jit(lambda p, s: engine._copy_prompts(p, s, copy, serial=serial))(pools, staged)
    for pool, kv, out in zip(pools, staged, got):
        want = pool.copy()
        for c, q in enumerate(prompt_C):
            for w in range(W):
                if shared_CW[c, w] < P_:
                    want[shared_CW[c, w]] = kv[q, w]
            if own_C[c] < P_:
                want[own_C[c]] = kv[q, min(partial_C[c], W - 1)]
        np.testing.assert_array_equal(np.asarray(out), want)
