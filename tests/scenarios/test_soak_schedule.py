"""The soak's fault schedule: replayable from its seed, within the blast radius, every allowed kind."""

from __future__ import annotations

import pytest

from harness.errors import ConfigError
from harness.scenarios.soak_schedule import KINDS, eligible_kinds, generate, parse_duration, role_cap

INV = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]
ALL = eligible_kinds(None, fabric=True)


def test_the_same_seed_gives_the_same_schedule_whatever_the_inventory_order():
    a = generate(7, INV, 900, ALL)
    b = generate(7, list(reversed(INV)), 900, ALL)
    assert a == b and a.to_dict() == b.to_dict()
    assert generate(8, INV, 900, ALL).faults != a.faults   # another seed, another schedule


def test_a_15_minute_schedule_has_the_acceptance_mix_and_overlaps():
    s = generate(0, INV, 900, ALL, faults_per_min=2.5)
    assert len(s.faults) >= 30
    assert len({f.kind for f in s.faults}) == len(ALL) == 6
    assert s.overlapping() > 0
    assert [f.index for f in s.faults] == list(range(len(s.faults)))
    assert all(f.offset_s + f.hold_s < 900 for f in s.faults)


@pytest.mark.parametrize("seed", range(20))
def test_never_more_than_the_blast_radius_of_a_role_and_never_one_worker_twice(seed):
    s = generate(seed, INV, 600, ALL, faults_per_min=6, max_role_share=0.5)
    for f in s.faults:
        at = [o for o in s.faults if o.offset_s <= f.offset_s < o.planned_until_s]
        assert sum(o.role == f.role for o in at) <= role_cap(2, 0.5) == 1, (f, at)
        assert sum(o.target == f.target for o in at) == 1
        assert f.role in KINDS[f.kind].roles


def test_kinds_come_in_rounds_and_fabric_kinds_need_a_fabric():
    s = generate(3, INV, 900, ALL)
    first = [f.kind for f in s.faults[:6]]
    assert sorted(first) == sorted(ALL)     # each allowed kind before any comes twice
    assert "nic_flap" not in eligible_kinds(None, fabric=False)
    assert eligible_kinds(["process_kill", "hbm_fill"], fabric=True) == ("process_kill", "hbm_fill")
    with pytest.raises(ConfigError, match="unknown fault kinds"):
        eligible_kinds(["process_kil"], fabric=True)


def test_a_lone_worker_of_a_role_is_never_faulted():
    s = generate(0, [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")], 600, ALL)
    assert s.faults and all(f.role == "decode" for f in s.faults)
    with pytest.raises(ConfigError, match="at least 2 workers"):
        generate(0, [("prefill-0", "prefill"), ("decode-0", "decode")], 600, ALL)


def test_durations_parse_and_bad_ones_name_the_fix():
    assert parse_duration("30m") == 1800 and parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    assert parse_duration("2.5m") == 150
    for bad in ("", "abc", "3x", "m", "0"):
        with pytest.raises(ConfigError, match="--soak=3m"):
            parse_duration(bad)
    with pytest.raises(ConfigError, match="no room for faults"):
        generate(0, INV, 25, ALL)
