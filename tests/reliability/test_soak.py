"""CI-sized soak: producers and consumers in their own processes against a 64 MiB pool
for 20 s; every byte a consumer gets is checked, and nothing is left behind."""

from __future__ import annotations

from pathlib import Path

from relkit import figures
from relkit.soak import CI, run_soak


def test_soak_ci(tmp_path: Path) -> None:
    result = run_soak(CI, tmp_path)
    print("\n" + figures.table("soak (CI)", result))
    figures.save("soak", result)
    assert result["violations"] == [], result["violations"]
    assert result["checksum_mismatches"] == 0
    assert result["views_verified"] > 0 and result["zero_copy_views"] > 0, result
    # Views kept past their block (and a lease TTL) were checked again while the pool churned.
    assert result["views_kept_after_block"] > 0 and result["kept_views_verified"] > 0, result
    assert result["pool_turnover"] >= 5, result  # the pool was refilled several times
