"""``bench.gpu_check``'s 8B-shape sections dry-run on the CPU (``--small``): the model built on
the device without a checkpoint, both backends timed over tables at the top of the pool, and
what the device run will be judged on reported."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.gpu_check import run_section


def test_the_8b_section_runs_small_and_reports_its_ratios(tmp_path: Path) -> None:
    out = run_section("steps_8b_bf16", tmp_path, "cpu", True, tmp_path)
    assert out["shape"] == "small" and out["bandwidth_gb_s"] > 0
    assert out["lowest_block_read"] == out["pool_blocks"] - 8 * 8
    for batch in (1, 8):
        row = out["batches"][batch]
        for k in ("k0", "k4"):
            assert row[k]["inplace_ms"] > 0 and row[k]["gather_ms"] > 0
            assert row[k]["over_bytes_read"] > 1  # no step beats reading its bytes once
        # bf16 kernels are not batch-invariant: a random model's near-tie may flip, one at most
        assert row["k0"]["inplace_gather_agreement"] >= 7 / 8
    assert out["flex_failed"] is None and out["flex_fallbacks"] == 0


@pytest.mark.slow  # flex compiles a kernel per case on a CPU (about 30 s)
def test_the_attention_section_runs_a_decode_a_tree_and_a_chunk_in_place(tmp_path: Path) -> None:
    out = run_section("attention_8b_bf16", tmp_path, "cpu", True, tmp_path)
    assert set(out["cases"]) >= {"decode_b1_1k", "tree_w4_b8_1k", "prompt_2k_after_6k"}
    for row in out["cases"].values():
        assert row["in_place"] and row["inplace_ms"] > 0 and row["gather_ms"] > 0
        assert row["max_abs_diff"] < 0.05  # bf16 rounding of values near 1
    assert out["flex_fallbacks"] == 0 and out["flex_plan_failures"] == {}


def test_the_moe_section_runs_small_and_reports_its_ratio(tmp_path: Path) -> None:
    out = run_section("moe_step_bf16", tmp_path, "cpu", True, tmp_path)
    assert out["shape"] == "small" and not out["grouped_experts"]  # stacked on a GPU only
    for batch in (1, 32):
        row = out["batches"][batch]
        assert row["step_ms"] > 0 and row["over_bytes_read"] > 1
        assert 4 <= row["experts_read"] <= 2 * 16  # top 4 of 16, two layers


def test_the_warm_up_section_steps_every_bucket_then_a_mixed_run(tmp_path: Path) -> None:
    out = run_section("warm_up_8b_bf16", tmp_path, "cpu", True, tmp_path)
    # seqs {1, 2, 4} x query {1, 2, 4, 5} x blocks {1, 2, ..., 32}
    assert out["buckets"] == 3 * 4 * 6 and out["warm_up_s"] > 0
    assert out["mixed_buckets_hit"] > 10 and out["ragged_steps"] == 3  # the prompt chunks
    assert out["compiles_during_mixed_run"] == out["captures_during_mixed_run"] == 0


def test_the_host_time_section_reports_each_batch_and_mode(tmp_path: Path) -> None:
    from bench.gpu_check import make_models

    make_models(tmp_path, "cpu", True)
    out = run_section("host_time_1b_bf16", tmp_path, "cpu", True, tmp_path)
    for mode in ("plain", "ngram_k4"):
        for batch in (1, 4):
            row = out[mode][batch]
            assert 0 < row["host_ms"] < row["step_ms"] and row["forward_ms"] > 0
    for batch in (1, 4):
        row = out["plain_overlap"][batch]
        assert (
            row["step_ms"] > 0
            and row["vs_plain"] == row["step_ms"] / out["plain"][batch]["step_ms"]
        )


def test_the_syncs_section_steps_every_drafter(tmp_path: Path) -> None:
    from bench.gpu_check import make_models

    make_models(tmp_path, "cpu", True)
    out = run_section("syncs", tmp_path, "cpu", True, tmp_path)
    assert not out["measured"]  # nothing waits on a device here: host reads are counted
    assert set(out["drafters"]) == {
        "plain",
        "plain_overlap",
        "ngram",
        "draft_model",
        "eagle",
        "eagle_tree",
    }
    # drafts read with the verdicts; overlapped steps each read once too (a step later)
    for chains in ("plain", "plain_overlap", "ngram", "draft_model", "eagle"):
        assert out["drafters"][chains]["syncs_per_step_max"] == 1, out["drafters"][chains]
    assert out["drafters"]["eagle_tree"]["syncs_per_step_median"] > 1  # a read per level
