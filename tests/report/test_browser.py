"""Open the report in headless Chromium: the verdict rows must render from the file alone."""

import shutil
import subprocess

import pytest

from harness.report import write_reports

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")]


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def test_verdicts_render_in_headless_chromium(tmp_path, sample_result):
    report = write_reports(sample_result, tmp_path / "reports") / "report.html"
    dom = _chromium(tmp_path, "--dump-dom", report.as_uri()).stdout
    assert dom.count('class="verdict"') == 3
    assert 'data-item="6.1.4" data-status="fail"' in dom
    assert 'data-item="nothing-lost" data-status="pass"' in dom
    assert "exit 1 — not conformant" in dom
    assert "p100 rescheduling time was 3.6 s [3.55-3.6, bounds], required &lt;= 3 s" in dom

    shot = tmp_path / "report.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,1800", report.as_uri())
    assert shot.stat().st_size > 10_000  # a rendered page, not a blank image
