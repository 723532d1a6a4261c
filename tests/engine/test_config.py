import pytest

from harness.cli import main
from harness.engine.core.config import PRESETS, EngineConfig, ModelConfig
from harness.errors import ConfigError


def test_kv_bytes_per_token_follows_section_2_2():
    tiny = ModelConfig.from_name("tiny")
    assert tiny.kv_bytes_per_token() == 2 * tiny.n_layers * tiny.n_kv_heads * tiny.head_dim * 8
    assert ModelConfig.from_name("tiny", dtype="float32").kv_bytes_per_token() == tiny.kv_bytes_per_token() // 2


def test_presets_grow_and_medium_makes_bandwidth_work_meaningful():
    sizes = [PRESETS[n].kv_bytes_per_token() for n in ("tiny", "small", "medium")]
    assert sizes == sorted(sizes)
    assert PRESETS["medium"].kv_bytes_per_token() >= 64 * 1024


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="tiny"):
        ModelConfig.from_name("huge")


@pytest.mark.parametrize("overrides, problem", [
    ({"n_heads": 4, "n_kv_heads": 3}, "multiple of n_kv_heads"),
    ({"head_dim": 15}, "even"),
    ({"dim": 0}, "dim"),
    ({"dtype": "int8"}, "dtype"),
    ({"vocab_size": 10}, "vocab_size"),
])
def test_model_config_rejects_bad_shapes(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        ModelConfig(**overrides)


def test_engine_config_derives_blocks_from_the_byte_budget():
    cfg = EngineConfig(preset="tiny", kv_budget_bytes=10 * 16 * 2048 + 5, block_size=16)
    assert cfg.block_bytes == 16 * 2048
    assert cfg.num_blocks == 10
    assert cfg.context_len == PRESETS["tiny"].max_seq_len


@pytest.mark.parametrize("overrides, problem", [
    ({"kv_budget_bytes": 100}, "kv_budget_bytes"),
    ({"max_model_len": 10**6}, "max_model_len"),
    ({"spec_draft_layers": 4}, "spec_draft_layers"),
    ({"device": "tpu"}, "device"),
    ({"block_size": 0}, "block_size"),
    ({"preset": "nope"}, "preset"),
])
def test_engine_config_rejects_bad_values(overrides, problem):
    with pytest.raises(ConfigError, match=problem):
        EngineConfig(**overrides)


def test_presets_subcommand_prints_kv_bytes(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name, cfg in PRESETS.items():
        assert name in out
        assert str(cfg.kv_bytes_per_token()) in out


def test_engine_dtype_override_is_validated_without_torch_at_import():
    from harness.engine.core.config import DTYPES, EngineConfig
    assert EngineConfig(preset="tiny", dtype="float32").model.dtype == "float32"
    assert EngineConfig(preset="tiny", dtype="float32").model.torch_dtype == DTYPES["float32"]
    with pytest.raises(ConfigError, match="unknown dtype 'int3'"):
        EngineConfig(preset="tiny", dtype="int3")
