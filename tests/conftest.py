"""Test set-up: 8 fake CPU devices, full-precision float32 matmuls, a compilation cache per run."""

import os
import shutil
import tempfile

# Must happen before jax is imported anywhere: multi-device code is tested on
# 8 fake CPU devices.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# With libtpu installed (the [tpu] extra) JAX would probe for a TPU at every start;
# TPU topologies for the AOT tests are still built on a CPU-only backend.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The entry points the tests run turn on the persistent compilation cache: one empty folder per
# pytest run, made here in the controller (the process without _TEST_CACHE) so its xdist
# workers and their subprocesses share it, keeps compiled programs out of the user's cache
# (even one set by EBPO_JAX_COMPILATION_CACHE) and every run as cold as CI's.
_TEST_CACHE = "EBPO_JAX_TEST_RUN_CACHE"
_OWN_CACHE = None
if _TEST_CACHE not in os.environ:
    _OWN_CACHE = os.environ[_TEST_CACHE] = tempfile.mkdtemp(prefix="ebpo_jax_test_xla_")
os.environ["EBPO_JAX_COMPILATION_CACHE"] = os.environ[_TEST_CACHE]

from ebpo_jax.runtime import compile_cache
from ebpo_jax.runtime.cpu_flags import add_cpu_flags

add_cpu_flags()  # the flags the entry points set, so tests run what users run

import jax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")
# The tests' own programs through the same cache: many build the same program anew (a fresh
# closure per test, a second worker, a subprocess), and XLA keys the cache by the program.
compile_cache.enable(os.environ["EBPO_JAX_COMPILATION_CACHE"])


def load_experiment(name: str):
    """experiments/<name>.py as a module, loaded once per process (its absl flags can be
    defined only once); test files share it through sys.modules."""
    import importlib.util
    import sys

    key = f"experiments.{name}"
    if key not in sys.modules:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.path.join(repo, "experiments", f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[key] = module
    return sys.modules[key]


# Out of the default suite to keep it under 12 minutes on a 2-core CPU (`make test-all` runs
# them): each has a cheaper sibling that stays in (another parametrization, the same property
# on one mesh or one model, or a guard that the script still imports).
SLOW_IN_THE_DEFAULT_SUITE = (
    "ablate_test.py::test_micro_grid_end_to_end_and_resume",
    "advantages_test.py::test_jit_equals_nojit_and_vmap",  # advantages_contract_test
    # padded_moe_update_over_context_4 and packed_logprobs_over_context_4 stay
    "context_parallel_test.py::test_packed_update_over_context_4_equals_one_device_with_lora",
    "distributed_test.py::test_only_process_0_writes_metrics_and_logs_but_all_checkpoint",
    "expert_parallel_test.py::test_generate_with_expert_parallel_equals_without[False]",  # dispatch
    "lora_test.py::test_lora_with_every_estimator[dr_grpo]",
    "lora_test.py::test_sampler_paths_agree",  # merged_forward_equals_adapter_forward
    "models_test.py::test_grouped_forward_equals_packed_rows_with_gradients[tiny_qwen3]",
    "models_test.py::test_scan_unroll_keeps_forward_and_gradients",
    "models_test.py::test_splash_attention_matches_xla_on_real_tokens",  # splash_packed_path
    "multihost_storage_test.py::test_two_hosts_on_gs_survive_a_kill_9_of_one_and_resume_bitwise",
    "multiturn_update_test.py::test_observation_tokens_are_out_of_the_loss[seq-mean-token-mean-24]",
    "sampler_test.py::test_dp_attention_sharded_equals_unsharded",
    "sampler_test.py::test_greedy_is_argmax_of_forward",  # greedy_matches_transformers[llama]
    "sampler_test.py::test_greedy_matches_transformers[qwen3]",
    "sampler_test.py::test_sharded_equals_unsharded[separate_mesh]",
    (
        "sampler_test.py::test_paged_layouts_equal_the_static_batch_row_for_row"
        "[sampled-slots6-page_size3-kv_pages7-live_buckets3]"
    ),
    "sampler_turns_test.py::test_continued_rows_draw_by_the_episode_keys",
    "sampler_turns_test.py::test_given_stop_ids_stop_nothing_and_token0_stops_continue",
    "scripts_test.py::test_lora_bench",
    "scripts_test.py::test_packed_bench",
    "scripts_test.py::test_rollout_bench",
    "scripts_test.py::test_train_bench_default_sizes_resolve_and_a_tiny_run",
    "storage_test.py::test_checkpoints_on_gs_commit_with_a_manifest_and_skip_a_corrupt_step",
    "trainer_test.py::test_covariance_losses_pick_their_share_of_tokens_in_the_update[clip_cov]",
    "trainer_test.py::test_no_checkpoint_is_saved_inside_a_nonfinite_streak",
    # importance_test (MIS) and exact_on_policy_test (mismatch/* of a shifted sampler) stay
    "trainer_test.py::test_recomputed_old_logprobs_match_the_sampler_and_measure_a_perturbed_one",
    "trainer_test.py::test_rollout_in_prompt_chunks_matches_one_call",
    "trainer_test.py::test_sampler_logprobs_equal_training_forward",
)


# The files that take longest in the default suite, longest first. pytest-xdist hands each
# worker one file at a time in collection order (the Makefile's --no-loadscope-reorder), so
# the last files the two workers start are short ones and they end together. A stale order
# costs only that balance.
LONGEST_FIRST = (
    "trainer_test.py",
    "sampler_test.py",
    "lora_test.py",
    "multihost_storage_test.py",
    "advantages_test.py",
    "scripts_test.py",
    "moe_test.py",
    "models_test.py",
    "train_cli_test.py",
    "losses_test.py",
    "packing_test.py",
    "context_parallel_test.py",
    "aot_test.py",
    "train_math_test.py",
    "batch_invariant_test.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Mark SLOW_IN_THE_DEFAULT_SUITE slow before `-m 'not slow'` deselects; LONGEST_FIRST's
    files first, the rest in their order."""
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW_IN_THE_DEFAULT_SUITE:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config):
    """Remove the run's compilation cache (the process that made it)."""
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
