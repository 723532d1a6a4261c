import pytest
import torch

from harness.engine.core.config import ModelConfig
from harness.engine.core.model import DenseKV, Transformer, causal_attention, torch_threads

CFG = ModelConfig.from_name("tiny")


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):  # as the engine runs; spare threads only spin on a shared machine
        yield


def _prefill(model: Transformer, tokens: list[int], n_layers: int | None = None, on_layer=None):
    kv = DenseKV(model.cfg.n_layers)
    hidden = model.forward(model.tensor(tokens), torch.arange(len(tokens)), kv, n_layers=n_layers,
                           on_layer=on_layer)
    return model.logits(hidden), kv


def test_weights_are_a_pure_function_of_the_config():
    a, b = Transformer(CFG), Transformer(CFG)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.layers[-1]["w2"], b.layers[-1]["w2"])
    other = Transformer(ModelConfig.from_name("tiny", seed=99))
    assert not torch.equal(a.embed, other.embed)


def test_logits_shape_and_dtype():
    logits, kv = _prefill(Transformer(CFG), [1, 2, 3, 4])
    assert logits.shape == (4, CFG.vocab_size)       # [T, V]
    assert logits.dtype == torch.float64
    assert kv.k[0].shape == (4, CFG.n_kv_heads, CFG.head_dim)


def test_incremental_decode_equals_full_prefill():
    model = Transformer(CFG)
    tokens = [5, 80, 33, 120, 7, 66]
    full, _ = _prefill(model, tokens)
    step, kv = _prefill(model, tokens[:3])
    for pos in range(3, len(tokens)):
        hidden = model.forward(model.tensor([tokens[pos]]), torch.tensor([pos]), kv)
        step = torch.cat([step, model.logits(hidden)])
    torch.testing.assert_close(step, full, rtol=0, atol=1e-12)


def test_causal_mask_hides_the_future():
    model = Transformer(CFG)
    a, _ = _prefill(model, [1, 2, 3, 4])
    b, _ = _prefill(model, [1, 2, 3, 200])
    torch.testing.assert_close(a[:3], b[:3], rtol=0, atol=1e-12)
    assert not torch.allclose(a[3], b[3])


def test_on_layer_sees_each_layer_in_order_before_the_next_runs():
    seen = []
    _, kv = _prefill(Transformer(CFG), [1, 2, 3], on_layer=lambda i, k, v: seen.append((i, k.shape, v.shape)))
    assert [i for i, _, _ in seen] == list(range(CFG.n_layers))
    assert all(k == (3, CFG.n_kv_heads, CFG.head_dim) for _, k, _ in seen)


def test_truncated_model_is_a_different_but_related_predictor():
    model = Transformer(CFG)
    full, _ = _prefill(model, list(range(40, 90)))
    draft, _ = _prefill(model, list(range(40, 90)), n_layers=1)
    agree = (full.argmax(-1) == draft.argmax(-1)).float().mean().item()
    assert 0.0 < agree < 1.0


def test_grouped_query_attention_matches_repeated_heads():
    q = torch.randn(3, 4, 8, dtype=torch.float64)
    k = torch.randn(5, 2, 8, dtype=torch.float64)
    v = torch.randn(5, 2, 8, dtype=torch.float64)
    out = causal_attention(q, k, v, start_pos=2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=torch.arange(5)[None, :] <= torch.arange(2, 5)[:, None]).transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_long_prompts_attend_in_query_blocks_with_the_same_result(monkeypatch):
    import harness.engine.core.model as model_module

    q = torch.randn(50, 4, 8, dtype=torch.float64)
    k = torch.randn(60, 2, 8, dtype=torch.float64)
    v = torch.randn(60, 2, 8, dtype=torch.float64)
    whole = causal_attention(q, k, v, start_pos=10)
    seen = []
    real = model_module._causal_block
    monkeypatch.setattr(model_module, "_causal_block", lambda *a: seen.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(model_module, "MAX_SCORE_ELEMENTS", 4 * 60 * 7)  # 7 query rows per block
    blocked = causal_attention(q, k, v, start_pos=10)
    assert seen == [7] * 7 + [1]
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_other_dtypes_build_the_same_model_approximately(dtype):
    low = Transformer(ModelConfig.from_name("tiny", dtype=dtype))
    logits, _ = _prefill(low, [1, 2, 3])
    ref, _ = _prefill(Transformer(CFG), [1, 2, 3])
    assert logits.dtype == getattr(torch, dtype)
    torch.testing.assert_close(logits.double(), ref, rtol=0.1, atol=0.5)
