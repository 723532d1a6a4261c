import statistics

import pytest

from harness.errors import ConfigError
from harness.probes.workload import LoadProfile, arrival_offsets, make_prompts


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
