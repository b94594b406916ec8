"""The paged decode estimate of aot_report against hand computations, and the issue-29 table."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

from ebpo_jax.pods import aot_report as aot
from ebpo_jax.pods.hardware import ChipSpec


def test_paged_schedule_by_hand():
    """Rows of 3, 1, 2 tokens in 2 slots, prompts of 10, pages of 4, kernel blocks of 8.

    Step 0: row 0 live at 11 tokens (row 1 ended at prefill); step 1: rows 0 and 2 at 12 and
    11. Reads round up to 16 each; own pages: 3 minus the 2 full prompt pages, per row.
    """
    sched = aot._paged_schedule(np.array([[3, 1, 2]]), 2, 10, 4, 8)
    np.testing.assert_array_equal(sched.live_SD[:, 0], [1, 2])
    np.testing.assert_array_equal(sched.kv_SD[:, 0], [11, 23])
    np.testing.assert_array_equal(sched.read_SD[:, 0], [16, 32])
    np.testing.assert_array_equal(sched.pages_SD[:, 0], [1, 2])


def test_decode_step_is_a_roofline_by_hand():
    spec = ChipSpec("x", 0, peak_flops=100.0, hbm_bandwidth=10.0, cores_in_name=1, torus_dims=2)
    cost = aot.DecodeCost(weight_bytes=100, kv_token_bytes=2, row_flops=10, kv_token_flops=1)
    # 2 rows reading 16 tokens: (100 + 32) / 10 s of traffic against (20 + 11) / 100 s of compute.
    assert cost.seconds(spec, 2, 16, 11) == pytest.approx(13.2)
    # 1000 rows: compute bound, (10000 + 50) / 100.
    assert cost.seconds(spec, 1000, 0, 50) == pytest.approx(100.5)


def test_decode_cost_of_a_model_by_hand():
    from ebpo_jax import models

    mc = models.get_config("qwen3_8b")
    cost = aot.decode_cost(mc, tp=4)
    # 36 layers x 8 kv heads x 128 dims x (K, V) x 2 bytes, over 4 chips.
    assert cost.kv_token_bytes == 36 * 8 * 128 * 2 * 2 / 4
    assert cost.weight_bytes == 2 * aot.total_params(mc) / 4
    assert cost.kv_token_flops == 4 * 36 * 32 * 128 / 4


def _qwen3_8b_aot(slots: int, **sampler):
    spec = importlib.util.spec_from_file_location("qwen3_8b", "configs/qwen3_8b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("aot")
    config.unlock()
    config.sampler.slots = slots
    config.sampler.update(sampler)
    return config


def _spec(config):
    from ebpo_jax.spec import resolve

    return resolve(config)


def test_static_paged_decode_equals_a_step_by_step_sum():
    """Every row at the limit, a slot per row: L - 1 steps, all rows live, summed by hand."""
    from ebpo_jax import models

    config = _qwen3_8b_aot(0, max_new_tokens=100, prompts_per_call=16, page_size=4)
    config.prompts_per_step = 16
    config.loss.num_minibatches = config.loss.num_microbatches = 1  # a valid split of 16 prompts
    config.loss.logits_chunk = 0  # (1024 does not divide 100 new tokens)
    mc = models.get_config("qwen3_8b")
    hw = aot.CHIPS["v5p"]
    lengths = aot.Lengths(prompt_tokens=10, at_limit=1.0)
    est = aot.step_time_estimate(
        _spec(config), mc, hw, prompt_len=16, layout=aot.SamplerLayout(2, 4), lengths=lengths
    )
    cost, rows, block = aot.decode_cost(mc, 4), 16 * 4 // 2, est["paged"]["kernel_block_tokens"]
    assert block == 16 * 4  # pages of 4 tokens, at most 16 pages per kernel block
    want = 0.0
    for t in range(1, 100):  # token t + 1 is written at decode step t
        kv = 10 + t
        read = -(-kv // block) * block
        traffic = (cost.weight_bytes + rows * read * cost.kv_token_bytes) / hw.hbm_bandwidth
        compute = rows * (cost.row_flops + kv * cost.kv_token_flops) / hw.peak_flops
        want += max(traffic, compute)
    assert est["decode_s_after"] == pytest.approx(want, rel=1e-9)
    assert est["paged"]["steps"] == 99 and est["paged"]["concurrent_rows"] == 64
    # Every row alike: the shards are even, and a slot per row leaves no refill to balance.
    assert est["paged"]["slowest_over_mean_shard"] == pytest.approx(1.0)
    assert est["paged"]["decode_s_even_shards"] == pytest.approx(want)
    assert est["paged"]["balanced_admission"] is None
    assert est["step_s_decode_update"] == pytest.approx(want + est["update_s_after_packed"])
    assert est["step_s_after"] == pytest.approx(sum(est["terms"]["at_peak"].values()))
    assert est["terms"]["at_peak"]["decode"] == est["decode_s_after"]
    assert any("slowest data shard" in a for a in est["assumptions"])


def test_dp_attention_paged_decode_equals_a_step_by_step_sum():
    """Rows over 2 data x 4 tp chips: each chip reads all kv heads of its 8 rows, and its
    weight slice runs the 32 rows of its tp group; summed by hand."""
    from ebpo_jax import models

    config = _qwen3_8b_aot(0, max_new_tokens=100, prompts_per_call=16, page_size=4)
    config.prompts_per_step = 16
    config.loss.num_minibatches = config.loss.num_microbatches = 1
    config.loss.logits_chunk = 0
    mc = models.get_config("qwen3_8b")
    hw = aot.CHIPS["v5p"]
    lengths = aot.Lengths(prompt_tokens=10, at_limit=1.0)
    est = aot.step_time_estimate(
        _spec(config), mc, hw, prompt_len=16, layout=aot.SamplerLayout(2, 4, True), lengths=lengths
    )
    split, block = aot.decode_cost(mc, 4), est["paged"]["kernel_block_tokens"]
    rows, group = 16 * 4 // 8, 16 * 4 // 2
    want = 0.0
    for t in range(1, 100):
        kv = 10 + t
        read = -(-kv // block) * block
        kv_bytes = rows * read * 4 * split.kv_token_bytes  # every head: 4x a tp chip's share
        traffic = (split.weight_bytes + kv_bytes) / hw.hbm_bandwidth
        compute = (group * split.row_flops + rows * kv * 4 * split.kv_token_flops) / hw.peak_flops
        want += max(traffic, compute)
    assert est["decode_s_after"] == pytest.approx(want, rel=1e-9)
    moves = est["paged"]["collectives_per_step"]
    assert moves["all_to_all"] == moves["all_reduce"] == 2 * mc.num_layers
    qkvo = (2 * mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim * 2
    assert moves["all_to_all_bytes_sent_per_chip"] == mc.num_layers * group * 3 / 16 * qkvo


@pytest.mark.slow
def test_issue_29_slots_table():
    """Qwen3-8B on v5p-64: today's blocked decode and the ideal per-row decode by slots."""
    from ebpo_jax import models

    mc = models.get_config("qwen3_8b")
    table = {256: (125, 60), 512: (125, 46), 1024: (133, 38), 2048: (245, 34)}
    for slots, (blocked, ideal) in table.items():
        est = aot.step_time_estimate(
            _spec(_qwen3_8b_aot(slots, page_size=128)), mc, aot.CHIPS["v5p"], prompt_len=4096,
            layout=aot.SamplerLayout(shards=8, tp=4),
        )  # fmt: skip
        assert round(est["decode_s_slots_blocked"]) == blocked
        assert round(est["decode_s_ragged_ideal"]) == ideal
        # The kernel rounds rows up to its blocks: a little above the ideal, far below blocked.
        assert ideal < est["decode_s_after"] < 1.2 * ideal


def test_paged_report_fields_by_hand():
    """Pool bytes per chip and the pages HBM would hold beside the train state, by hand."""
    from types import SimpleNamespace

    from ebpo_jax import models
    from ebpo_jax.pods import aot as aot_compile

    mc = models.get_config("qwen3_8b", dtype="bfloat16")
    page = aot_compile.page_bytes_per_chip(mc, 128, tp=4)
    assert page == 128 * (2 * 8 // 4) * 128 * 36 * 2  # tokens x kv heads per chip x dim x layers
    plan = SimpleNamespace(pages=1000, shards=8, slots=256, rows=256, impl="pallas_tpu")
    spec = SimpleNamespace(page_size=128, dp_attention=False, kv_dtype="")
    mesh = SimpleNamespace(shape={"data": 8, "tp": 4})
    gib = 2**30
    report = lambda name, args, peak: aot.ProgramReport(
        name, "", args, 0, 0, peak - args, 0, 95 * gib, 0.0, 1.0
    )
    reports = [report("train update", 4 * gib, 17 * gib), report("sampler decode", 0, 30 * gib)]
    meta = aot_compile.paged_meta(plan, spec, mc, mesh, reports)
    assert meta["kv_pages"] == 8000 and meta["concurrent_rows"] == 2048
    assert meta["pool_gib_per_chip"] == pytest.approx(1000 * page / gib)
    assert meta["decode_peak_with_train_state_gib_per_chip"] == pytest.approx(34)
    assert meta["headroom_gib_per_chip"] == pytest.approx(95 - 4 - 30)
    assert "2048 of 2048 rows at once" in aot.paged_lines({"paged": meta})[0]


def test_dapo_refill_scales_the_decode_not_the_update():
    from ebpo_jax.pods.aot_report import with_refill

    est = {"decode_s_after": 40.0, "update_s_after_packed": 25.0, "step_s_after": 65.0}
    est["assumptions"] = ["a"]
    got = with_refill(est, 2.5)
    assert (got["decode_s_after"], got["step_s_after"]) == (100.0, 125.0)
    assert got["refill"] == {
        "generated_per_kept": 2.5,
        "one_round": {"decode_s_after": 40.0, "step_s_after": 65.0},
    }
    assert got["assumptions"][0] == "a" and "2.5 tokens generated" in got["assumptions"][1]
    assert est["step_s_after"] == 65.0  # the input is left as it was


def test_balanced_refill_lands_rows_on_the_least_loaded_shard():
    """Shard 0 owns two 10-token rows, shard 1 two 2-token rows, one slot each. In row order
    shard 0 decodes 9 + 9 steps while shard 1 idles after 2; balanced, the queue's rows go
    10, 10 to both shards, then 2, 2: 10 steps, both shards live at every one."""
    lengths = np.array([[10, 10], [2, 2]])
    in_order = aot._paged_schedule(lengths, 1, 10, 4, 8)
    balanced = aot._paged_schedule(lengths, 1, 10, 4, 8, balance=True)
    assert len(in_order.live_SD) == 18 and in_order.live_SD[2:, 1].sum() == 0
    assert len(balanced.live_SD) == 10
    np.testing.assert_array_equal(balanced.live_SD, np.ones((10, 2)))
    # Equal KV on both shards at every step: the row 9 steps long on each, then a 1-step row.
    np.testing.assert_array_equal(balanced.kv_SD[:, 0], balanced.kv_SD[:, 1])


def test_element_bytes_follow_the_sampler_dtypes():
    from types import SimpleNamespace

    from ebpo_jax.pods.step_terms import element_bytes

    mc = SimpleNamespace(param_dtype="float32", dtype="bfloat16", hidden_size=4096, head_dim=128)
    sampler = lambda w, kv: SimpleNamespace(param_dtype=w, kv_dtype=kv)
    assert element_bytes(sampler("", ""), mc) == (4.0, 2.0)  # the trainer's, the model's
    assert element_bytes(sampler("bfloat16", ""), mc) == (2.0, 2.0)
    # int8 plus a float32 scale per output channel / per token and kv head.
    assert element_bytes(sampler("int8", "int8"), mc) == (1 + 4 / 4096, 1 + 4 / 128)


def test_int8_halves_the_decode_bytes():
    from ebpo_jax import models
    from ebpo_jax.pods.step_terms import ElementBytes

    mc = models.get_config("qwen3_8b")
    bf16, int8 = aot.decode_cost(mc, 8, True), aot.decode_cost(mc, 8, True, ElementBytes(1, 1))
    assert int8.weight_bytes * 2 == bf16.weight_bytes == 2 * aot.total_params(mc) / 8
    assert int8.kv_token_bytes * 2 == bf16.kv_token_bytes == 36 * 8 * 128 * 2 * 2


def test_weight_move_bytes_by_hand():
    from ebpo_jax.pods import step_terms as st

    move = st.WeightMove(1000, 4.0, st.ElementBytes(1.0, 1.0), 10, 4, quantize=True, moved=True)
    # Quantize on the trainer's 100 weights per chip: read float32 twice, write int8; then
    # each chip receives its 1000 / tp = 250 int8 weights.
    assert st.weight_move_bytes(move) == {"hbm_bytes_per_chip": 900.0, "ici_bytes_per_chip": 250.0}
    cast = move._replace(dst=st.ElementBytes(2.0, 2.0), quantize=False)
    assert st.weight_move_bytes(cast) == {"hbm_bytes_per_chip": 600.0, "ici_bytes_per_chip": 500.0}
    same = move._replace(dst=st.ElementBytes(4.0, 2.0), moved=False)
    assert st.weight_move_bytes(same) == {"hbm_bytes_per_chip": 0.0, "ici_bytes_per_chip": 0.0}


def test_collective_bytes_for_a_known_mesh_by_hand():
    from ebpo_jax import models
    from ebpo_jax.pods import step_terms as st

    mc = models.get_config("qwen3_8b")
    moves = aot.collectives_per_step(mc, 512, 8, True)
    # Two ring all-reduces per layer of 512 rows x 4096 bf16, each sending 2 x 7/8 of it.
    assert moves["all_reduce_bytes_sent_per_chip"] == 72 * 2 * 7 / 8 * 512 * 4096 * 2
    assert aot.collectives_per_step(mc, 512, 1, False)["all_reduce_bytes_sent_per_chip"] == 0
    # FSDP over 4 chips, 2 micro-batches, 3 gathers (forward, backward, reference) of bf16
    # weights and a float32 reduce-scatter: 3/4 of 1000 params each.
    fsdp = st.update_collective_bytes(1000, {"fsdp": 4}, 2, gathers=3)
    assert fsdp == {"count": 8, "bytes_sent_per_chip": 2 * (3 * 750 * 2 + 750 * 4)}


def test_terms_priced_at_peak_and_expected_by_hand():
    from ebpo_jax.pods import step_terms as st

    chip = ChipSpec("x", 0, 100.0, 10.0, 1, 2, ici_bandwidth=5.0)
    eff = st.Efficiency(update_mfu=0.5, decode_bandwidth=0.25, ici=0.0, collective_latency_s=1.0)
    terms = {
        "update": st.Priced(flops=200.0, mfu="update_mfu"),  # 2 s, 4 at 50% MFU
        "move": st.Priced(hbm_bytes=10.0, ici_bytes=10.0, collectives=3),  # 1 + 2 s
        "decode": st.Priced(roofline_s=1.0),  # 4 s at 25% of HBM bandwidth
        "fsdp": st.Priced(ici_bytes=5.0, in_update_mfu=True),  # inside the update's MFU
        "reward": st.Priced(seconds=7.0),
    }
    got = st.priced_terms(terms, chip, eff)
    assert got["at_peak"] == {"update": 2.0, "move": 3.0, "decode": 1.0, "fsdp": 1.0, "reward": 7.0}
    # ICI at 1/2 on a 2-d torus (a ring's 2 links of 4), 1 s latency per collective.
    assert got["expected"] == {"update": 4.0, "move": 4 + 4 + 3, "decode": 4.0, "fsdp": 0.0,
                               "reward": 7.0}  # fmt: skip
    assert st.reward_seconds(2048, 0) == pytest.approx(2048 * st.REWARD_S_PER_RESPONSE / 4)
    assert st.reward_seconds(2048, 64, hosts=8) == pytest.approx(
        256 * st.REWARD_S_PER_RESPONSE / 64
    )
    sampling = lambda k, p: SimpleNamespace(top_k=k, top_p=p)
    assert st.sampling_bytes_per_row(1000, sampling(0, 1.0), 4) == 5 * 1000 * 4 / 4
    assert st.sampling_bytes_per_row(1024, sampling(0, 0.9), 1) == (5 + 20) * 1024 * 4


def test_int8_sampler_dtypes_price_the_decode_by_hand():
    """The step-by-step sum of test_static_paged_decode..., at int8 weight and KV bytes; the
    complete step adds every term."""
    import dataclasses

    from ebpo_jax import models
    from ebpo_jax.pods.step_terms import element_bytes

    config = _qwen3_8b_aot(0, max_new_tokens=100, prompts_per_call=16, page_size=4)
    config.prompts_per_step = 16
    config.loss.num_minibatches = config.loss.num_microbatches = 1
    config.loss.logits_chunk = 0
    spec = _spec(config)
    # The config check refuses int8 until the int8 KV cache and weights are built: set past it.
    sampler = dataclasses.replace(spec.rollout.sampler, kv_dtype="int8", param_dtype="int8")
    spec = dataclasses.replace(spec, rollout=dataclasses.replace(spec.rollout, sampler=sampler))
    mc = models.get_config("qwen3_8b")
    hw = aot.CHIPS["v5p"]
    lengths = aot.Lengths(prompt_tokens=10, at_limit=1.0)
    est = aot.step_time_estimate(
        spec, mc, hw, prompt_len=16, layout=aot.SamplerLayout(2, 4), lengths=lengths
    )
    cost = aot.decode_cost(mc, 4, elem=element_bytes(sampler, mc))
    rows, block = 32, est["paged"]["kernel_block_tokens"]
    want = sum(
        max(
            (cost.weight_bytes + rows * -(-(10 + t) // block) * block * cost.kv_token_bytes)
            / hw.hbm_bandwidth,
            rows * (cost.row_flops + (10 + t) * cost.kv_token_flops) / hw.peak_flops,
        )
        for t in range(1, 100)
    )
    assert est["decode_s_after"] == pytest.approx(want, rel=1e-9)
    assert est["element_bytes"] == {"weight": 1 + 4 / 4096, "kv": 1 + 4 / 128}
    terms = est["terms"]
    assert set(terms["at_peak"]) == {"decode", "sampling", "prefill", "weight_move",
                                     "decode_collectives", "update", "update_collectives",
                                     "reward"}  # fmt: skip
    assert all(terms["expected"][k] >= v for k, v in terms["at_peak"].items() if "update" not in k)
    assert est["step_s_after"] == pytest.approx(sum(terms["at_peak"].values()))
    assert est["step_s_expected"] == pytest.approx(sum(terms["expected"].values()))
    # 8 chips are 2 hosts of 4: each scores the responses of 8 of the 16 prompts.
    from ebpo_jax.pods import step_terms as st

    responses, workers = 16 * spec.rollout.group_size, spec.task.data.reward_workers
    assert terms["at_peak"]["reward"] == pytest.approx(
        responses / 2 * st.REWARD_S_PER_RESPONSE / (workers or st.DEFAULT_REWARD_WORKERS)
    )


def test_dapo_refill_repeats_the_rollout_terms_not_the_update():
    from ebpo_jax.pods.aot_report import with_refill

    row = {"decode": 40.0, "reward": 5.0, "update": 25.0, "update_collectives": 2.0}
    est = {"decode_s_after": 40.0, "update_s_after_packed": 25.0, "assumptions": []}
    est["terms"] = {"at_peak": row, "expected": {k: 2 * v for k, v in row.items()}}
    got = with_refill(est, 2.0)
    assert got["terms"]["at_peak"] == {**row, "decode": 80.0, "reward": 10.0}
    assert (got["step_s_after"], got["step_s_expected"]) == (117.0, 234.0)


def test_a_tp_that_splits_a_kv_head_is_refused_by_the_config_and_the_estimate():
    """Qwen3-30B-A3B's 4 kv heads cannot split over tp=8: one line naming sampler.mesh, from
    the config's checks and from the estimator itself; tp=4 is accepted by both."""
    from ebpo_jax import models
    from ebpo_jax.schema import ConfigError

    config = _qwen3_8b_aot(0)
    config.model.preset = "qwen3_30b_a3b"
    config.sampler.mesh, config.sampler.dp_attention = "data=4,tp=8", False
    with pytest.raises(
        ConfigError, match=r"^sampler.mesh='data=4,tp=8': tp=8 does not divide .* 4 kv heads"
    ):
        _spec(config)
    config.sampler.mesh = "data=8,tp=4"
    spec = _spec(config)
    mc, chip = models.get_config("qwen3_30b_a3b"), aot.CHIPS["v5p"]
    est = lambda tp: aot.step_time_estimate(
        spec, mc, chip, prompt_len=4096, layout=aot.SamplerLayout(shards=32 // tp, tp=tp)
    )
    assert est(4)["decode_s_after"] > 0
    with pytest.raises(ValueError, match=r"^sampler.mesh: tp=8 does not divide .* 4 kv heads"):
        est(8)


def test_expert_parallel_reads_a_shards_experts_and_prices_its_collectives_by_hand():
    """Qwen3-30B-A3B's experts split over 2 data shards (sampler.expert_parallel): each chip
    reads half the experts, and each of the 48 sparse layers adds an all-gather of a shard's
    rows (bf16 activations, int32 ids, bf16 weights) and a reduce-scatter of bf16 outputs."""
    from ebpo_jax import models

    mc = models.get_config("qwen3_30b_a3b")
    experts = 48 * 128 * 3 * 2048 * 768
    off, on = aot.decode_cost(mc, 4), aot.decode_cost(mc, 4, expert_shards=2)
    assert off.weight_bytes - on.weight_bytes == pytest.approx(2 * experts / 2 / 4)
    assert (on.row_flops, on.kv_token_bytes) == (off.row_flops, off.kv_token_bytes)
    config = _qwen3_8b_aot(0, max_new_tokens=100, prompts_per_call=16, page_size=4)
    config.prompts_per_step = 16
    config.loss.num_minibatches = config.loss.num_microbatches = 1
    config.loss.logits_chunk = 0
    hw, lengths = aot.CHIPS["v5p"], aot.Lengths(prompt_tokens=10, at_limit=1.0)
    est = {
        ep: aot.step_time_estimate(_spec(config), mc, hw, prompt_len=16, lengths=lengths,
                                   layout=aot.SamplerLayout(2, 4, False, ep))
        for ep in (False, True)
    }  # fmt: skip
    rows = 16 * 4 // 2  # a data shard's rows, every step
    moves = est[True]["paged"]["collectives_per_step"]
    assert moves["all_gather"] == moves["reduce_scatter"] == 48
    assert moves["all_gather_bytes_sent_per_chip"] == 48 * rows * (2048 * 2 + 8 * (4 + 2))
    assert moves["reduce_scatter_bytes_sent_per_chip"] == 48 * rows * 2048 * 2
    assert "all_gather" not in est[False]["paged"]["collectives_per_step"]
    steps = est[True]["paged"]["steps_all_calls"]
    added = steps * (48 * rows * (2048 * 2 + 48) + 48 * rows * 2048 * 2) / hw.ici_bandwidth
    peak = lambda ep: est[ep]["terms"]["at_peak"]["decode_collectives"]
    assert peak(True) - peak(False) == pytest.approx(added)
    assert est[True]["decode_s_after"] < est[False]["decode_s_after"]
    move = lambda ep: est[ep]["terms"]["at_peak"]["weight_move"]  # each chip its half of them
    assert move(False) - move(True) == pytest.approx(2 * experts / 2 / 4 / hw.ici_bandwidth)
