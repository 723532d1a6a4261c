"""The soak as users run it (issue 27 acceptance, the CI-sized version): a real subprocess of
`pytest suites/test_soak.py --soak=2m --soak-faults-per-min=4 --soak-seed=24` on the real bundled
cluster, honest and with a planted KV leak; the same seed replays the same schedule (dry runs and
real runs). Seed 24 at 4 faults a minute puts all six kinds in two minutes, the kill first (its
restart has the most to do) and four of them overlapping; 3m at 2 a minute held five kinds and cost
CI two more minutes.

Overrides, stated: on this shared 2-core CI box rescheduling has taken up to 7 s with other test
runs competing for the cores (tests/harness/test_acceptance.py), so the fault rule's 3 s is
relaxed to 10 s here; the shipped checklist keeps 3 s. The leaky cluster is clusters/local-leaky.yaml
with the same overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.harness.test_soak_dry_run import ROOT, run

RELAXED = {"soak.faults": {"reschedule_p100_s": 10.0}}
SOAK = ["--soak=2m", "--soak-faults-per-min=4", "--soak-seed=24", "--live=plain"]


def cluster_file(tmp_path: Path, base: str) -> Path:
    data = yaml.safe_load((ROOT / "clusters" / f"{base}.yaml").read_text())
    data["name"] = f"{base}-soak"
    data.setdefault("thresholds", {}).update(RELAXED)
    path = tmp_path / f"{base}-soak.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def by_item(data: dict) -> dict[str, dict]:
    return {v["item"]: v for v in data["verdicts"]}


@pytest.mark.slow
@pytest.mark.root
@pytest.mark.timeout(2000)
def test_a_2_minute_soak_passes_the_honest_cluster_catches_a_planted_leak_and_replays_its_schedule(tmp_path):
    honest_proc, honest = run(tmp_path, "honest", f"--cluster={cluster_file(tmp_path, 'local')}", *SOAK)
    v = by_item(honest)
    assert not honest["harness_errors"] and not honest["revert_failures"], honest["harness_errors"]
    assert v["soak.faults"]["status"] == "pass", v["soak.faults"]["reason"]
    assert v["soak.leaks"]["status"] == "pass", v["soak.leaks"]["reason"]
    assert v["nothing-lost"]["status"] == "pass", v["nothing-lost"]["reason"]
    assert v["soak.slo"]["status"] in ("pass", "fail", "inconclusive") and v["soak.slo"]["evidence"]["windows"]
    kinds = {o["kind"] for o in honest["soak"]["outcomes"] if o["status"] == "recovered"}
    assert len(kinds) >= 5, honest["soak"]["by_kind"]

    leaky_proc, leaky = run(tmp_path, "leaky", f"--cluster={cluster_file(tmp_path, 'local-leaky')}", *SOAK)
    lv = by_item(leaky)
    assert leaky_proc.returncode == 1, leaky_proc.stdout[-4000:]
    assert lv["soak.leaks"]["status"] == "fail" and "decode-" in lv["soak.leaks"]["reason"], lv["soak.leaks"]["reason"]

    # the same seed on the same inventory: the same schedule, and each fault injected as planned
    assert honest["soak"]["schedule"] == leaky["soak"]["schedule"]
    for data in (honest, leaky):
        planned = [(f["kind"], f["target"], f["offset_s"]) for f in data["soak"]["schedule"]["faults"]]
        assert [(o["kind"], o["target"], o["planned_offset_s"]) for o in data["soak"]["outcomes"]] == planned
        records = {r["fault_id"]: r for r in data["faults"] if r["action"] == "inject"}
        done = [o for o in data["soak"]["outcomes"] if o["status"] != "not injected"]
        assert len(done) >= len(planned) - 1, data["soak"]["outcomes"]
        for o in done:   # the fault runner's own record of it: that kind, on that worker, near its offset
            rec = records[o["fault_id"]]
            assert rec["kind"] == o["kind"], (rec, o)
            if o["kind"] not in ("nic_flap", "pfc_storm"):   # those name the worker's NIC and namespace
                assert o["target"] in rec["target"], (rec, o)
            assert o["planned_offset_s"] <= o["offset_s"] <= o["planned_offset_s"] + 60, o
