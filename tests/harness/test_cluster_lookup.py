"""`--cluster NAME`: ./clusters/ of the current directory first, then the examples shipped in the
package; the default checklist is loaded from the package."""

import pytest

from harness.checklists import DEFAULT_CHECKLIST, Checklist
from harness.clusterfile import CLUSTERS_DIR, cluster_search_path, resolve_cluster_path
from harness.errors import ConfigError


def test_cwd_clusters_win_over_shipped_examples(tmp_path, monkeypatch):
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "local.yaml").write_text("name: local\nkind: bundled\n")
    (tmp_path / "clusters" / "mine.yaml").write_text("name: mine\nkind: bundled\n")
    monkeypatch.chdir(tmp_path)
    assert cluster_search_path() == [tmp_path / "clusters", CLUSTERS_DIR]
    assert resolve_cluster_path("local") == tmp_path / "clusters" / "local.yaml"
    assert resolve_cluster_path("mine") == tmp_path / "clusters" / "mine.yaml"
    assert resolve_cluster_path("example-prod") == CLUSTERS_DIR / "example-prod.yaml"  # shipped


def test_without_a_clusters_folder_the_shipped_ones_are_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cluster_search_path() == [CLUSTERS_DIR]
    assert resolve_cluster_path("local") == CLUSTERS_DIR / "local.yaml"
    with pytest.raises(ConfigError) as err:
        resolve_cluster_path("mine")
    assert (f"looked for mine.yaml in 1. ./clusters/ of the current directory ({tmp_path / 'clusters'}: no such "
            f"folder), then 2. the shipped examples ({CLUSTERS_DIR})") in str(err.value)
    assert "put mine.yaml in ./clusters/" in str(err.value)
    assert "local" in str(err.value)  # the known names are listed


def test_default_checklist_ships_inside_the_package_and_is_the_documented_file():
    assert DEFAULT_CHECKLIST.parent.parent.name == "harness"
    assert DEFAULT_CHECKLIST.resolve().read_text() == (DEFAULT_CHECKLIST.parents[2] / "checklists" /
                                                        "section6.yaml").read_text()
    assert Checklist.load().item("6.1.1").title
