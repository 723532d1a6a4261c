import statistics

import pytest

from harness.errors import ConfigError
from harness.probes.loadgen.workload import LoadProfile, arrival_offsets, make_prompts


def test_poisson_schedule_is_seeded_and_has_the_requested_mean_rate():
    a = arrival_offsets("poisson", 50.0, 200.0, seed=7)
    assert a == arrival_offsets("poisson", 50.0, 200.0, seed=7)
    assert a != arrival_offsets("poisson", 50.0, 200.0, seed=8)
    assert len(a) / 200.0 == pytest.approx(50.0, rel=0.03)      # 10k arrivals: sd ~1 %
    gaps = [b - x for x, b in zip(a, a[1:])]
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    # exponential gaps: standard deviation equals the mean (a constant schedule's is 0)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    assert all(0 <= t < 200.0 for t in a) and a == sorted(a)


def test_constant_schedule_is_evenly_spaced_inside_the_duration():
    assert arrival_offsets("constant", 4.0, 1.0, seed=0) == [0.0, 0.25, 0.5, 0.75]
    assert len(arrival_offsets("constant", 3.0, 10.0, seed=0)) == 30


def test_prompts_are_deterministic_and_vary_in_length():
    prof = LoadProfile(prompt_min_chars=10, prompt_max_chars=80, num_prompts=50, seed=3)
    prompts = make_prompts(prof)
    assert prompts == make_prompts(prof)
    assert prompts != make_prompts(LoadProfile(prompt_min_chars=10, prompt_max_chars=80, num_prompts=50, seed=4))
    assert all(10 <= len(p) <= 80 for p in prompts)
    assert len({len(p) for p in prompts}) > 10


def test_profile_round_trips_and_rejects_bad_values_with_a_fix():
    prof = LoadProfile(mode="poisson", rate=3.5, users=4, seed=9)
    assert LoadProfile.from_json(prof.to_json()) == prof
    with pytest.raises(ConfigError, match="needs rate > 0"):
        LoadProfile(mode="poisson")
    with pytest.raises(ConfigError, match="only meaningful for open-loop"):
        LoadProfile(mode="closed", rate=2.0)
    with pytest.raises(ConfigError, match="load mode 'burst' is unknown"):
        LoadProfile(mode="burst")
    with pytest.raises(ConfigError, match="users must be a positive integer"):
        LoadProfile(users=0)
    with pytest.raises(ConfigError, match="3 users cannot be spread over 4 processes"):
        LoadProfile(users=3, processes=4)
    with pytest.raises(ConfigError, match="processes must be an integer from 1 to 64"):
        LoadProfile(processes=0)
    with pytest.raises(ConfigError, match="unknown fields"):
        LoadProfile.from_json('{"rps": 3}')


def test_prompts_sized_in_tokens_follow_the_measured_ratio_and_the_mix():
    from harness.probes.loadgen.workload import make_requests, prompt_chars

    prof = LoadProfile(prompt_tokens=50, max_tokens=7, chars_per_token=4.0, token_overhead=2.0, num_prompts=20)
    assert prompt_chars(prof, 50) == 192  # (50 - 2 tokens of overhead) * 4 chars
    reqs = make_requests(prof)
    assert all(mt == 7 and 185 <= len(p) <= 192 for p, mt in reqs), [len(p) for p, _ in reqs]
    assert len({p for p, _ in reqs}) == 20  # distinct prompts (no accidental prefix-cache hits)
    mixed = LoadProfile(mix=((10, 3, 1.0), (100, 5, 3.0)), chars_per_token=1.0, num_prompts=400, seed=3)
    out = make_requests(mixed)
    assert out == make_requests(mixed)
    long = [p for p, mt in out if mt == 5]
    assert {len(p) <= 10 for p, mt in out if mt == 3} == {True} and all(95 <= len(p) <= 100 for p in long)
    assert 0.65 < len(long) / len(out) < 0.85  # weight 3 of 4
    # a round trip through JSON (the Locust process) keeps the mix
    assert LoadProfile.from_json(mixed.to_json()) == mixed


def test_token_sizing_without_a_measured_ratio_and_bad_shapes_say_what_to_do():
    from harness.probes.loadgen.workload import make_requests

    with pytest.raises(ConfigError, match="characters per token") as err:
        make_requests(LoadProfile(prompt_tokens=10))
    assert "LoadRunner" in err.value.fix
    for bad in ({"mix": ((0, 3, 1.0),)}, {"mix": ((10, 3, 0),)}, {"mix": ((10,),)}, {"requests": 0},
                {"prompt_tokens": 0}, {"chars_per_token": -1.0}):
        with pytest.raises(ConfigError):
            LoadProfile(**bad)


def test_cluster_workload_becomes_profile_fields_and_a_suites_max_tokens_wins():
    from harness.clusterfile.models import Workload
    from harness.probes.loadgen.workload import workload_profile

    wl = Workload(prompt_tokens=300, output_tokens=40,
                  mix=[{"prompt_tokens": 300, "output_tokens": 40, "weight": 3},
                       {"prompt_tokens": 2000, "output_tokens": 8, "weight": 1}])
    assert workload_profile(None, {}) == {}
    assert workload_profile(wl, {}) == {"prompt_tokens": 300, "max_tokens": 40,
                                        "mix": ((300, 40, 3.0), (2000, 8, 1.0))}
    assert workload_profile(wl, {"max_tokens": 32})["mix"] == ((300, 32, 3.0), (2000, 32, 1.0))
