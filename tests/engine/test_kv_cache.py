import pytest
import torch

from harness.engine.core.config import ModelConfig
from harness.engine.core.kv_cache import KVBlockData, KVBlockPool, PagedAttention
from harness.engine.core.model import DenseKV, Transformer, causal_attention, torch_threads
from harness.errors import KVCapacityError, KVIntegrityError

CFG = ModelConfig.from_name("tiny")


@pytest.fixture(autouse=True)
def one_torch_thread():
    with torch_threads(1):  # as the engine runs; spare threads only spin on a shared machine
        yield


def _pool(num_blocks: int = 8, block_size: int = 4) -> KVBlockPool:
    return KVBlockPool(num_blocks, CFG.n_layers, CFG.n_kv_heads, block_size, CFG.head_dim, torch.float64)


def test_blocks_cycle_through_the_free_list():
    pool = _pool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and pool.num_used == 3
    with pytest.raises(KVCapacityError, match="only 1 of 4"):
        pool.allocate(2)
    pool.free(a)
    assert pool.num_free == 4 and pool.num_used == 0
    pool.check_invariants()


def test_the_blocks_freed_last_are_handed_out_first_in_their_order_each_once():
    pool = _pool(8)
    a, b = pool.allocate(3), pool.allocate(2)
    pool.share([a[1]])
    pool.free(a)  # a[1] is still held by its sharer
    pool.free(b)
    assert pool.allocate(4) == [*b, a[0], a[2]]  # the memory touched last, still in cache
    pool.free([a[1]])
    assert list(pool.free_blocks).count(a[1]) == 1 and pool.allocate(1) == [a[1]]
    [c] = pool.allocate(1)
    pool.share([c])
    pool.free([c, c])  # both references in one call: back once
    assert list(pool.free_blocks).count(c) == 1 and pool.num_free == 3
    pool.check_invariants()


def test_reference_counts_keep_shared_blocks_alive_and_catch_double_free():
    pool = _pool(2)
    [b] = pool.allocate(1)
    pool.share([b])
    pool.free([b])
    assert pool.num_free == 1
    pool.free([b])
    assert pool.num_free == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


def test_quarantined_block_is_never_handed_out_again():
    pool = _pool(3)
    blocks = pool.allocate(3)
    pool.quarantine(blocks[1])
    pool.free(blocks)
    assert sorted(pool.allocate(2)) == sorted([blocks[0], blocks[2]])
    with pytest.raises(KVCapacityError):
        pool.allocate(1)
    pool.check_invariants()


def test_poisoned_block_is_quarantined_or_left_in_service_and_restore_zeroes_it():
    pool = _pool(4)
    a, b = pool.allocate(2)
    pool.poison(a)                    # handled: out of service
    pool.poison(b, quarantine=False)  # ignored: its owner keeps it, NaN
    assert pool.poisoned == {a, b} and pool.quarantined == {a}
    assert torch.isnan(pool.storage[a]).all() and torch.isnan(pool.storage[b]).all()
    pool.free([a, b])
    assert b in pool.free_blocks and a not in pool.free_blocks  # b goes back to service poisoned
    [c] = pool.allocate(1)
    assert pool.restore() == 2  # a back to service, b (reused as c or not) zeroed where it is
    assert not pool.poisoned and not pool.quarantined
    assert (pool.storage[a] == 0).all() and (pool.storage[b] == 0).all()
    pool.free([c])
    assert pool.num_free == 4
    pool.check_invariants()


def test_a_block_restored_while_still_held_returns_to_service_when_its_holder_frees_it():
    """The ECC fault is reverted while the poisoned block's request still references it: the page
    is replaced when the request lets go (zeroed then, never under the holder), not left out of
    service for good (a kill-point run found it quarantined after its revert)."""
    pool = _pool(4)
    a, b = pool.allocate(2)
    pool.poison(a)
    assert pool.restore() == 1 and a in pool.quarantined and a not in pool.free_blocks  # still held
    assert torch.isnan(pool.storage[a]).all()  # not zeroed under its holder
    pool.free([a, b])
    assert not pool.quarantined and not pool.poisoned and pool.num_free == 4
    assert (pool.storage[a] == 0).all()
    pool.check_invariants()


def test_paged_attention_matches_dense_attention_over_scattered_blocks():
    """Tolerance: 1e-12 absolute in float64 (paged only gathers the same numbers)."""
    pool = _pool(8, block_size=4)
    gen = torch.Generator().manual_seed(0)
    table = [6, 1, 4]  # deliberately out of order
    pool.allocate(8)
    ctx = 10
    k = torch.randn(ctx, CFG.n_kv_heads, CFG.head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(ctx, CFG.n_kv_heads, CFG.head_dim, generator=gen, dtype=torch.float64)
    q = torch.randn(3, CFG.n_heads, CFG.head_dim, generator=gen, dtype=torch.float64)
    pool.write(1, *pool.slots(table, 0, 7), k[:7], v[:7])
    out = PagedAttention(pool, [(table, 7, 3)]).attend(1, q, k[7:], v[7:])
    torch.testing.assert_close(out, causal_attention(q, k, v, 7), rtol=0, atol=1e-12)
    gk, gv = pool.gather(1, table, ctx)
    assert torch.equal(gk, k) and torch.equal(gv, v)


def test_model_over_paged_blocks_matches_dense_and_gives_the_same_greedy_tokens():
    model = Transformer(CFG)
    pool = _pool(16, block_size=4)
    tables = [pool.allocate(4), pool.allocate(3)]
    seqs = [[3, 9, 27, 81, 243, 7, 21, 63, 189, 55, 11], [200, 100, 50, 25, 12, 6]]
    # packed batch of two prefills over paged KV
    hidden = model.forward(model.tensor(seqs[0] + seqs[1]),
                           torch.tensor(list(range(11)) + list(range(6))),
                           PagedAttention(pool, [(tables[0], 0, 11), (tables[1], 0, 6)]))
    paged = model.logits(hidden)
    for n, (seq, start) in enumerate(zip(seqs, (0, 11))):
        dense = model.logits(model.forward(model.tensor(seq), torch.arange(len(seq)), DenseKV(CFG.n_layers)))
        torch.testing.assert_close(paged[start:start + len(seq)], dense, rtol=0, atol=1e-10)
        assert torch.equal(paged[start:start + len(seq)].argmax(-1), dense.argmax(-1))


def test_exported_block_round_trips_with_its_checksum():
    src, dst = _pool(2), _pool(2)
    [b] = src.allocate(1)
    src.storage[b] = torch.randn(src.storage.shape[1:], dtype=torch.float64)
    payload = src.export_block(b)
    [t] = dst.allocate(1)
    dst.import_block(t, payload)
    assert torch.equal(dst.storage[t], src.storage[b])


def test_altered_block_bytes_fail_the_checksum_and_are_never_written():
    src, dst = _pool(2), _pool(2)
    [b] = src.allocate(1)
    src.storage[b] = 1.5
    payload = src.export_block(b)
    corrupt = bytearray(payload.data)
    corrupt[100] ^= 0x01  # one flipped bit
    [t] = dst.allocate(1)
    with pytest.raises(KVIntegrityError, match="checksum mismatch"):
        dst.import_block(t, KVBlockData(bytes(corrupt), payload.checksum))
    assert torch.count_nonzero(dst.storage[t]) == 0


def test_payload_of_the_wrong_size_is_rejected():
    pool = _pool(2, block_size=4)
    other = _pool(2, block_size=8)
    [b] = other.allocate(1)
    [t] = pool.allocate(1)
    with pytest.raises(KVIntegrityError, match="block_size"):
        pool.import_block(t, other.export_block(b))


@pytest.mark.parametrize("chunk_bytes, view_min", [(1, 10**9), (2**30, 10**9), (2**30, 0)])
def test_batched_decode_attention_matches_dense_per_sequence(monkeypatch, chunk_bytes, view_min):
    """Padded batches (one sequence per chunk / all in one) and contiguous views agree with dense."""
    import harness.engine.core.kv_cache as kv_cache
    monkeypatch.setattr(kv_cache, "BATCH_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(kv_cache, "VIEW_MIN_CONTEXT", view_min)
    model = Transformer(CFG)
    pool = _pool(32, block_size=4)
    seqs = [list(range(40, 40 + n)) for n in (3, 17, 9)]  # contexts of different block counts
    tables = [pool.allocate(pool.blocks_for(len(s) + 1)) for s in seqs]
    pool.storage[tables[0][-1]] = float("nan")  # stale garbage past a context must stay masked out
    for seq, table in zip(seqs, tables):
        model.forward(model.tensor(seq[:-1]), torch.arange(len(seq) - 1),
                      PagedAttention(pool, [(table, 0, len(seq) - 1)]))
    hidden = model.forward(model.tensor([s[-1] for s in seqs]), torch.tensor([len(s) - 1 for s in seqs]),
                           PagedAttention(pool, [(t, len(s) - 1, 1) for s, t in zip(seqs, tables)]))
    for row, seq in zip(model.logits(hidden), seqs):
        dense = model.logits(model.forward(model.tensor(seq), torch.arange(len(seq)), DenseKV(CFG.n_layers)))
        torch.testing.assert_close(row, dense[-1], rtol=0, atol=1e-10)


def test_batched_multi_token_attention_matches_dense_per_sequence():
    """Speculative verify shape: several new tokens per sequence, causal inside the batch."""
    model = Transformer(CFG)
    pool = _pool(32, block_size=4)
    seqs = [list(range(60, 60 + n)) for n in (6, 13, 21)]
    tables = [pool.allocate(pool.blocks_for(len(s))) for s in seqs]
    new = 4
    for seq, table in zip(seqs, tables):
        model.forward(model.tensor(seq[:-new]), torch.arange(len(seq) - new),
                      PagedAttention(pool, [(table, 0, len(seq) - new)]))
    hidden = model.forward(model.tensor([t for s in seqs for t in s[-new:]]),
                           torch.cat([torch.arange(len(s) - new, len(s)) for s in seqs]),
                           PagedAttention(pool, [(t, len(s) - new, new) for s, t in zip(seqs, tables)]))
    logits = model.logits(hidden).view(len(seqs), new, -1)
    for rows, seq in zip(logits, seqs):
        dense = model.logits(model.forward(model.tensor(seq), torch.arange(len(seq)), DenseKV(CFG.n_layers)))
        torch.testing.assert_close(rows, dense[-new:], rtol=0, atol=1e-10)


def _decode_logits(model, pool, seq, table):
    """Prefill seq[:-1] into the pool, then one decode step of seq[-1]: its logits."""
    model.forward(model.tensor(seq[:-1]), torch.arange(len(seq) - 1), PagedAttention(pool, [(table, 0, len(seq) - 1)]))
    return model.logits(model.forward(model.tensor(seq[-1:]), torch.tensor([len(seq) - 1]),
                                      PagedAttention(pool, [(table, len(seq) - 1, 1)])))[0]


def test_a_write_outside_attention_drops_the_contiguous_view_and_the_next_step_reads_the_blocks(monkeypatch):
    import harness.engine.core.kv_cache as kv_cache
    monkeypatch.setattr(kv_cache, "VIEW_MIN_CONTEXT", 0)  # every sequence attends over its view
    model = Transformer(CFG)
    pool = _pool(16, block_size=4)
    seq = list(range(50, 60))
    table = pool.allocate(pool.blocks_for(len(seq) + 1))
    _decode_logits(model, pool, seq, table)
    assert table[0] in pool.views
    src = _pool(16, block_size=4)  # another sequence's bytes imported over block 1 (e.g. a swap-in)
    other_table = src.allocate(pool.blocks_for(len(seq) + 1))
    _decode_logits(model, src, list(range(70, 80)), other_table)
    pool.import_block(table[1], src.export_block(other_table[1]))
    assert table[0] not in pool.views
    step = PagedAttention(pool, [(table, len(seq), 1)])  # rebuilt from the blocks, not from stale bytes
    assert torch.equal(pool.views[table[0]].kv[:, :, 4:8], src.views[other_table[0]].kv[:, :, 4:8])
    assert step.viewed[0][0] is pool.views[table[0]].kv


def test_poisoned_block_in_service_is_read_by_its_owner_and_a_released_block_takes_no_stale_view(monkeypatch):
    import harness.engine.core.kv_cache as kv_cache
    monkeypatch.setattr(kv_cache, "VIEW_MIN_CONTEXT", 0)
    model = Transformer(CFG)
    pool = _pool(16, block_size=4)
    seq = list(range(50, 60))
    table = pool.allocate(pool.blocks_for(len(seq) + 1))
    assert torch.isfinite(_decode_logits(model, pool, seq, table)).all()
    pool.poison(table[0], quarantine=False)  # an engine that ignores page retirement
    hidden = model.forward(model.tensor([1]), torch.tensor([len(seq)]), PagedAttention(pool, [(table, len(seq), 1)]))
    assert torch.isnan(hidden).all()
    pool.restore()
    pool.free(table)
    assert pool.views == {}
    again = pool.allocate(pool.blocks_for(len(seq) + 1))
    fresh = _decode_logits(model, pool, seq, again)
    dense = model.logits(model.forward(model.tensor(seq), torch.arange(len(seq)), DenseKV(CFG.n_layers)))[-1]
    torch.testing.assert_close(fresh, dense, rtol=0, atol=1e-10)
