"""``bench.gpu_check``'s 8B-shape section dry-run on the CPU (``--small``): it builds the model on
the device without a checkpoint, times both backends over tables at the top of the pool, and
reports what the device run will be judged on."""

from __future__ import annotations

from pathlib import Path

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
