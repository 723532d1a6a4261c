import pytest

from harness.checklists import DEFAULT_CHECKLIST, Checklist, default_checklist
from harness.errors import ConfigError


def test_bundled_checklist_holds_the_article_numbers():
    cl = Checklist.load()
    t = cl.threshold("6.1.4", "reschedule_p100_s")
    assert (t.value, t.op, t.unit, t.article) == (3.0, "<=", "s", True)
    assert cl.threshold("6.1.1", "line_rate_fraction").value == 0.8
    assert cl.threshold("6.1.2", "ttft_delta_loaded_ms").value == 200
    assert cl.threshold("6.2.tpot", "tpot_p99_ms").value == 80
    assert cl.threshold("6.1.4", "min_faults_per_kind").article is False
    assert "3s" in cl.item("6.1.4").source


def test_threshold_comparison():
    t = Checklist.load().threshold("6.1.4", "reschedule_p100_s")
    assert t.holds(2.99) and t.holds(3.0) and not t.holds(3.01)
    assert t.describe() == "<= 3 s"


def test_overrides_replace_values_and_record_origin():
    cl = Checklist.load().with_overrides({"6.1.4": {"reschedule_p100_s": 5}}, origin="clusters/x.yaml")
    t = cl.threshold("6.1.4", "reschedule_p100_s")
    assert t.value == 5.0 and t.origin == "clusters/x.yaml" and t.op == "<="
    assert Checklist.load().threshold("6.1.4", "reschedule_p100_s").value == 3.0  # original untouched


@pytest.mark.parametrize("overrides, field", [
    ({"9.9": {"x": 1}}, "thresholds.9.9"),
    ({"6.1.4": {"reschedule_p101_s": 1}}, "thresholds.6.1.4.reschedule_p101_s"),
    ({"6.1.4": {"reschedule_p100_s": "fast"}}, "thresholds.6.1.4.reschedule_p100_s"),
    ({"6.1.4": 3}, "thresholds.6.1.4"),
])
def test_bad_overrides_name_file_field_and_fix(overrides, field):
    with pytest.raises(ConfigError) as err:
        Checklist.load().with_overrides(overrides, origin="clusters/x.yaml")
    msg = str(err.value)
    assert "clusters/x.yaml" in msg and f"`{field}`" in msg and "fix:" in msg


def test_malformed_checklist_file(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("items:\n  a:\n    title: t\n    source: s\n    why: w\n"
                   "    thresholds:\n      k: {value: 1, op: '=<', unit: s}\n")
    with pytest.raises(ConfigError, match=r"items\.a\.thresholds\.k\.op"):
        Checklist.load(bad)
    bad.write_text("items: [\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        Checklist.load(bad)
    with pytest.raises(ConfigError, match="file not found"):
        Checklist.load(tmp_path / "missing.yaml")


def test_unknown_item_lists_known_ones():
    with pytest.raises(ConfigError, match="6.1.4"):
        Checklist.load(DEFAULT_CHECKLIST).item("6.1.9")


@pytest.mark.parametrize("threshold, field, fix", [
    ("{value: .inf, op: '<', unit: s}", "items.a.thresholds.k.value", "write a plain number"),
    ("{value: true, op: '<', unit: s}", "items.a.thresholds.k.value", "write a plain number"),
    ("{value: 1, op: '<', unit: s, orign: harness}", "items.a.thresholds.k.orign", "did you mean `origin`?"),
    ("{value: 1, op: '<', origin: paper}", "items.a.thresholds.k.origin", "use article or harness"),
])
def test_a_bad_threshold_entry_names_its_field_and_fix(tmp_path, threshold, field, fix):
    bad = tmp_path / "c.yaml"
    bad.write_text(f"items:\n  a:\n    title: t\n    source: s\n    why: w\n    thresholds:\n      k: {threshold}\n")
    with pytest.raises(ConfigError) as err:
        Checklist.load(bad)
    assert f"`{field}`" in str(err.value) and fix in str(err.value)


def test_an_unquoted_numeric_item_id_is_read_as_its_text(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("items:\n  6.1:\n    title: t\n    source: s\n    why: w\n    thresholds:\n"
                    "      k: {value: 2, op: '>=', origin: harness}\n")
    t = Checklist.load(path).threshold("6.1", "k")
    assert (t.value, t.op, t.unit, t.article, t.origin) == (2.0, ">=", "", False, str(path))


def test_the_shipped_checklist_is_parsed_once_and_shared():
    assert default_checklist() is default_checklist()
    assert default_checklist() == Checklist.load(DEFAULT_CHECKLIST)
