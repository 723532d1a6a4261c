"""Selectors (Chaos Mesh's modes and label filters over the inventory) and the blast radius: exact
counts, seeded picks, and a clear refusal naming the fix for every selector that cannot be met."""

from __future__ import annotations

import pytest

from harness.clusterfile import load_cluster
from harness.clusterfile.load import parse_cluster
from harness.errors import ConfigError, FaultError
from harness.faults.blast_radius import check_blast_radius, role_limits
from harness.faults.process import ProcessHang
from harness.faults.selectors import Candidate, Selector, candidates_from_inventory, candidates_from_workers


def _inventory() -> list[Candidate]:
    """16 aggregated workers on 4 hosts in 2 racks, plus 4 prefill and 4 decode workers."""
    out = [Candidate(f"agg-{i:02d}", "aggregated", f"h{i % 4}", f"r{i % 2}") for i in range(16)]
    out += [Candidate(f"pre-{i}", "prefill", "h0", "r0") for i in range(4)]
    return out + [Candidate(f"dec-{i}", "decode", "h1", "r1") for i in range(4)]


@pytest.mark.parametrize("text, roles, expected", [
    ("one", ["aggregated"], 1), ("all", ["aggregated"], 16), ("fixed:3", ["aggregated"], 3), ("5", [], 5),
    ("percent:25", ["aggregated"], 4), ("25%", ["aggregated"], 4), ("fixed-percent:10", ["aggregated"], 1),
    ("percent:10", [], 2), ("percent:100", ["decode"], 4), ("all", [], 24),
])
def test_each_mode_picks_exactly_its_count(text, roles, expected):
    selection = Selector.parse(text, roles=roles).select(_inventory(), seed=7)
    assert len(selection.chosen) == expected
    assert len({c.name for c in selection.chosen}) == expected  # no target twice
    assert all(c.role in roles for c in selection.chosen) if roles else True


def test_random_max_percent_stays_between_one_and_the_percentage():
    counts = {len(Selector.parse("random-max-percent:50", roles=["aggregated"]).select(_inventory(), seed=s).chosen)
              for s in range(60)}
    assert counts <= set(range(1, 9)) and len(counts) > 3  # 1..8 of 16, and really random over seeds


def test_the_same_seed_picks_the_same_targets_and_another_seed_others():
    sel = Selector.parse("percent:25", roles=["aggregated"])
    picks = [tuple(c.name for c in sel.select(_inventory(), seed=s).chosen) for s in (1, 1, 2, 3, 4)]
    assert picks[0] == picks[1]
    assert len(set(picks[1:])) > 1
    # the order of the inventory does not matter: the matches are sorted first
    assert tuple(c.name for c in sel.select(list(reversed(_inventory())), seed=1).chosen) == picks[0]


def test_label_filters_combine_across_labels_and_any_value_within_one():
    inv = _inventory()
    chosen = Selector.parse("all", roles=["aggregated"], racks=["r1"], hosts=["h1", "h3"]).select(inv).chosen
    assert {c.name for c in chosen} == {f"agg-{i:02d}" for i in range(16) if i % 2 == 1}
    assert {c.name for c in Selector.parse("all", names=["agg-1*", "dec-0"]).select(inv).chosen} == \
        {f"agg-{i}" for i in range(10, 16)} | {"dec-0"}


@pytest.mark.parametrize("text, message, fix", [
    ("percent:150", "percentage in (0, 100]", "at most 100"),
    ("percent:0", "percentage in (0, 100]", "percent"),
    ("random-max-percent:-5", "percentage in (0, 100]", "random-max-percent"),
    ("fixed:0", "whole number of targets >= 1", "fixed:3"),
    ("fixed:2.5", "whole number", "fixed:3"),
    ("one:3", "takes no value", "fixed:N"),
    ("some", "unknown selector mode 'some'", "percent:P"),
    ("percent:lots", "not a number", "percent:P"),
    ("percent:nan", "not a finite number", "percent:P"),
])
def test_bad_selectors_are_refused_naming_the_fix(text, message, fix):
    with pytest.raises(ConfigError, match="selector") as info:
        Selector.parse(text)
    assert message in info.value.message and fix in (info.value.fix or "")


def test_selectors_that_the_inventory_cannot_meet_are_refused_naming_the_fix():
    inv = _inventory()
    with pytest.raises(ConfigError, match="asks for 5 targets but only 4 match") as info:
        Selector.parse("fixed:5", roles=["decode"]).select(inv)
    assert "fixed:4" in info.value.fix
    with pytest.raises(ConfigError, match="matches no target") as info:
        Selector.parse("one", roles=["router"]).select(inv)
    assert "roles: aggregated, decode, prefill" in info.value.message and "racks: r0, r1" in info.value.message
    with pytest.raises(ConfigError, match="10 % of 4 matching target.s. is 0") as info:
        Selector.parse("percent:10", roles=["decode"]).select(inv)
    assert "at least 25 %" in info.value.fix
    with pytest.raises(ConfigError, match="the inventory lists no workers"):
        Selector.parse("all").select([])


def test_candidates_come_from_the_cluster_file_with_racks_and_from_admin_workers():
    spec = load_cluster("dynamo-many")
    inv = candidates_from_inventory(spec)
    assert [c.name for c in inv] == [f"mocker-{i:02d}" for i in range(16)]
    assert {(c.role, c.host, c.rack) for c in inv} == {("aggregated", "localhost", None)}
    racked = parse_cluster({
        "name": "racked", "kind": "external", "endpoints": {"api": "http://127.0.0.1:19201"},
        "hosts": [{"name": "a", "address": "10.0.0.1", "roles": ["decode"], "rack": "r7"}],
        "workers": [{"name": "w", "role": "decode", "host": "a", "api": "http://10.0.0.1:1"}]}, source="test")
    assert candidates_from_inventory(racked)[0].rack == "r7"
    admin = candidates_from_workers([{"id": "decode-0", "role": "decode", "pid": 42, "host": None},
                                     {"id": "decode-1", "role": "decode", "pid": None}])
    assert [(c.name, c.host) for c in admin] == [("decode-0", "localhost")]  # no pid: nothing to fault


class _Limit:
    def __init__(self, share: float) -> None:
        self.max_role_share_down = share


def test_blast_radius_allows_up_to_the_share_and_refuses_past_it_naming_what_fits():
    inv = _inventory()
    assert role_limits(inv, 0.25) == {"aggregated": 4, "prefill": 1, "decode": 1}
    four = Selector.parse("percent:25", roles=["aggregated"]).select(inv).chosen
    lines = check_blast_radius(four, inv, _Limit(0.25), cluster="c")
    assert lines == ["blast radius: 4 of 16 aggregated worker(s) down at once (0 already faulted), limit 4 "
                     "(max_role_share_down 0.25)"]
    five = Selector.parse("fixed:5", roles=["aggregated"]).select(inv).chosen
    with pytest.raises(FaultError, match="exceeds safety.blast_radius: 5 of 16 aggregated") as info:
        check_blast_radius(five, inv, _Limit(0.25), cluster="c")
    assert "nothing was touched" in info.value.message and "at most 4 more aggregated" in info.value.fix
    # per role: two decode workers of four break a 0.25 limit even though 2 of 24 workers is less
    with pytest.raises(FaultError, match="2 of 4 decode"):
        check_blast_radius(Selector.parse("fixed:2", roles=["decode"]).select(inv).chosen, inv, _Limit(0.25),
                           cluster="c")
    assert "no limit" in check_blast_radius(five, inv, None, cluster="c")[0]


def test_blast_radius_counts_the_workers_already_faulted():
    inv = _inventory()
    held = [ProcessHang(pid=4242, worker_id="agg-00", role="aggregated"),
            ProcessHang(pid=4243, worker_id="agg-01", role="aggregated"),
            ProcessHang(pid=4244, worker_id="not-in-inventory")]
    three = [c for c in inv if c.name in ("agg-02", "agg-03", "agg-04")]
    with pytest.raises(FaultError, match=r"5 of 16 aggregated worker\(s\) down at once \(2 already faulted\)") as info:
        check_blast_radius(three, inv, _Limit(0.25), cluster="c", active_faults=held)
    assert "at most 2 more" in info.value.fix
    # a target already held counts once
    again = [c for c in inv if c.name in ("agg-00", "agg-02")]
    assert "3 of 16" in check_blast_radius(again, inv, _Limit(0.25), cluster="c", active_faults=held)[0]


def test_the_cluster_file_takes_a_blast_radius_and_refuses_a_bad_one():
    base = {"name": "b", "kind": "external", "endpoints": {"api": "http://127.0.0.1:19201"}}
    spec = parse_cluster({**base, "safety": {"blast_radius": {"max_role_share_down": 0.1}}}, source="test")
    assert spec.safety.blast_radius.max_role_share_down == 0.1
    for bad in (0, 1.5, "lots"):
        with pytest.raises(ConfigError, match="max_role_share_down") as info:
            parse_cluster({**base, "safety": {"blast_radius": {"max_role_share_down": bad}}}, source="test")
        assert "0.25" in str(info.value)
    assert load_cluster("dynamo-many").safety.blast_radius.max_role_share_down == 0.25
