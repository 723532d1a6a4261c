"""The 6.1.3 by-load verdict's plot: the engine's KV use with the cluster file's level thresholds, and
the stated level in force over time, drawn from the verdict's evidence."""

from harness.report.plots import kv_drive_plot

EVIDENCE = {
    "levels": [{"level": 3, "kv_use_above": 0.9}, {"level": 2, "kv_use_above": 0.8}],
    "kv_use_series": [{"t_wall": 100.0 + i, "kv_use": kv} for i, kv in enumerate((0.1, 0.5, 0.85, 0.95, None, 0.2))],
}


def test_the_plot_shows_kv_use_each_threshold_and_the_level_in_force():
    svg = str(kv_drive_plot(EVIDENCE))
    assert "KV use over time" in svg and "Degradation level over time" in svg
    assert "L2 above 80%" in svg and "L3 above 90%" in svg


def test_no_series_or_no_levels_draws_nothing():
    assert kv_drive_plot({}) is None
    assert kv_drive_plot({"levels": EVIDENCE["levels"], "kv_use_series": []}) is None
    assert kv_drive_plot({"kv_use_series": EVIDENCE["kv_use_series"]}) is None
