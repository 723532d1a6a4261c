"""The NVML probe: on a GPU machine it lists every device with its HBM and ECC counters; elsewhere
it says why not (no library, no driver), and the report's environment simply has no ``gpus``."""

from harness.probes.workers.gpu import gpu_inventory, nvml_unavailable_reason
from harness.report import collect_environment


def test_inventory_or_reason():
    reason = nvml_unavailable_reason()
    gpus = gpu_inventory()
    if reason is None:
        assert gpus and all(g["memory_total_bytes"] > 0 and g["name"] for g in gpus)
        assert [g["name"] for g in collect_environment()["gpus"]] == [g["name"] for g in gpus]
    else:
        assert gpus is None
        assert "nvidia-ml-py" in reason or "NVML" in reason
        assert "gpus" not in collect_environment()


def test_without_the_library_the_reason_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    assert nvml_unavailable_reason() == "nvidia-ml-py is not installed (pip install 'harness[gpu]')"
    assert gpu_inventory() is None
