"""Contract tests run over every tier, plus the table's init and sparse Adam pinned to torch's SparseAdam."""

import numpy as np
import pytest
import torch

from store.configs import TableConfig
from store.errors import StoreError
from store.frozen import FrozenTier
from store.init import initial_vectors, initial_vectors_numpy
from store.ram import RamTier
from store.rocks import RocksTier
from store.sparse_optim import SparseOptimConfig
from store.table import EmbeddingTable
from store.tier import Tier
from tests.helpers import TIERS, WIDTH, ram_tier


@pytest.fixture(params=sorted(TIERS))
def tier(request, tmp_path) -> Tier:
    return TIERS[request.param](tmp_path)


def test_implements_interface(tier):
    assert isinstance(tier, Tier)


def test_the_optional_capabilities_answer_on_every_tier(tier):
    """Declared in store/tier.py with what a tier without them does, so the table calls them on any tier."""
    ids = np.arange(1, 6, dtype=np.int64)
    rows = torch.arange(5 * WIDTH, dtype=torch.float32).view(5, WIDTH)
    tier.load_rows(ids, rows)
    got, found = tier.read(ids)
    assert found.all() and torch.equal(got.cpu(), rows)
    assert tier.expire_cold() == 0  # nothing has a TTL here
    expired = tier.take_expired()
    assert expired.dtype == np.int64 and len(expired) == 0
    stats = tier.stats()
    assert stats and all(isinstance(v, float) for v in stats.values())
    assert isinstance(tier.prefetches, bool)
    tier.prefetch(ids)  # a hint: reads stay exact
    assert torch.equal(tier.read(ids)[0].cpu(), rows)
    tier.close()


def test_a_tier_missing_a_required_method_cannot_be_built():
    class Half(Tier):
        width, capacity_bytes = 4, 0

        def read(self, ids):
            return torch.zeros((len(ids), 4)), np.zeros(len(ids), bool)

    with pytest.raises(TypeError, match="abstract"):
        Half()


def test_round_trip_any_64_bit_id(tier):
    ids = np.array([0, 1, 2**63 - 1, -(2**63), 123456789012345], dtype=np.int64)
    rows = torch.arange(len(ids) * WIDTH, dtype=torch.float32).view(-1, WIDTH)
    tier.write(ids, rows)
    back, found = tier.read(ids[::-1].copy())
    assert found.all()
    torch.testing.assert_close(back.cpu(), rows.flip(0))  # a device tier answers on its device
    assert len(tier) == 5 and set(tier.all_ids().tolist()) == set(ids.tolist())


def test_missing_ids_are_reported_not_invented(tier):
    tier.write(np.array([5], dtype=np.int64), torch.ones(1, WIDTH))
    rows, found = tier.read(np.array([5, 6], dtype=np.int64))
    assert found.tolist() == [True, False]
    assert rows[1].abs().sum() == 0


def test_overwrite_and_remove(tier):
    ids = np.array([1, 2, 3], dtype=np.int64)
    tier.write(ids, torch.zeros(3, WIDTH))
    tier.write(np.array([2], dtype=np.int64), torch.full((1, WIDTH), 7.0))
    assert tier.remove(np.array([1, 9], dtype=np.int64)) == 1
    rows, found = tier.read(ids)
    assert found.tolist() == [False, True, True] and rows[1, 0] == 7.0
    tier.write(np.array([10, 11], dtype=np.int64), torch.ones(2, WIDTH))  # reuses the freed slot
    assert len(tier) == 4 and tier.read(np.array([11], dtype=np.int64))[1].all()


def test_growth_keeps_rows(tier):
    for start in range(0, 100, 10):
        ids = np.arange(start, start + 10, dtype=np.int64)
        tier.write(ids, torch.from_numpy(np.repeat(ids[:, None], WIDTH, 1).astype(np.float32)))
    rows, found = tier.read(np.arange(100, dtype=np.int64))
    assert found.all() and rows[:, 0].tolist() == list(range(100))


@pytest.mark.parametrize("table_format", ["plain", "block"])
def test_rocks_tier_reads_and_scans_its_table_files(tmp_path, table_format):
    """Rows that left the memtable for table files (hash-indexed PlainTable files, scanned from the
    first key in total order) read, scan, overwrite and remove as in memory, after a compaction and
    after a reopen. The contract tests above never leave the memtable."""
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 3000, dtype=np.int64))
    expected = dict(zip(ids.tolist(), rng.normal(size=(len(ids), WIDTH)).astype(np.float32), strict=True))
    tier = RocksTier(tmp_path / "db", WIDTH, 1 << 30, table_format=table_format)
    tier.write(ids, torch.from_numpy(np.stack([expected[i] for i in ids.tolist()])))
    tier.db.flush()
    for i in ids[:100].tolist():  # overwritten in the memtable, over rows in a table file
        expected[i] = expected[i] + 1
    tier.write(ids[:100], torch.from_numpy(np.stack([expected[i] for i in ids[:100].tolist()])))
    assert tier.remove(ids[100:200]) == 100
    for i in ids[100:200].tolist():
        del expected[i]
    tier.db.flush()
    tier.db.compact_range(None, None)
    fresh = np.array([0, 1, -1], dtype=np.int64)  # in the memtable only
    tier.write(fresh, torch.zeros(3, WIDTH))
    expected.update({i: np.zeros(WIDTH, np.float32) for i in fresh.tolist()})

    def check(tier: RocksTier) -> None:
        assert sorted(tier.all_ids().tolist()) == sorted(expected) and len(tier) == len(expected)
        rows, found = tier.read(ids)
        assert found.tolist() == [i in expected for i in ids.tolist()]
        assert torch.equal(rows[found], torch.from_numpy(np.stack([expected[i] for i in ids[found].tolist()])))

    check(tier)
    tier.close()
    check(RocksTier(tmp_path / "db", WIDTH, 1 << 30, table_format=table_format))


def test_rocks_tier_reads_a_database_written_with_block_based_files(tmp_path):
    """Checkpoints from before the PlainTable change hold block-based files: they still read."""
    from rocksdict import Options, Rdict

    ids = np.array([5, -7, 1 << 40], dtype=np.int64)
    rows = torch.arange(3 * WIDTH, dtype=torch.float32).reshape(3, WIDTH)
    with_meta = np.concatenate([rows.numpy().view(np.uint8), np.zeros((3, 16), np.uint8)], axis=1)
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    old = Rdict(str(tmp_path / "db"), options=options)  # RocksDB's default table format: block-based
    keys = [i.to_bytes(8, "big", signed=True) for i in ids.tolist()]  # the tier's key: 8 big-endian bytes
    for key, value in zip(keys, with_meta, strict=True):
        old[key] = value.tobytes()
    old.flush()
    old.close()
    tier = RocksTier(tmp_path / "db", WIDTH, 1 << 30)
    got, found = tier.read(ids)
    assert found.all() and torch.equal(got, rows) and sorted(tier.all_ids().tolist()) == sorted(ids.tolist())


def test_budget_is_enforced_with_a_clear_error():
    tier = ram_tier(capacity_bytes=3 * RamTier(WIDTH, 1).row_bytes)
    tier.write(np.arange(3, dtype=np.int64), torch.zeros(3, WIDTH))
    with pytest.raises(StoreError, match="ram_bytes"):
        tier.write(np.array([99], dtype=np.int64), torch.zeros(1, WIDTH))
    with pytest.raises(StoreError, match="capacity_bytes"):
        RamTier(WIDTH, 0)


def test_initial_vectors_deterministic_and_spread():
    ids = np.array([1, 2, 2**62 + 5, -7], dtype=np.int64)
    a = initial_vectors(ids, 8, seed=3, std=0.1)
    assert torch.equal(a, initial_vectors(ids, 8, seed=3, std=0.1))
    assert not torch.equal(a, initial_vectors(ids, 8, seed=4, std=0.1))
    assert not torch.equal(a[0], a[1])
    big = initial_vectors(np.arange(20_000, dtype=np.int64), 8, seed=0, std=0.1)
    assert abs(float(big.std()) - 0.1) < 0.005 and abs(float(big.mean())) < 0.005


@pytest.mark.parametrize("dim", [1, 5, 17])
@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3])
def test_initial_vectors_compiled_pass_equals_the_numpy_definition_bit_for_bit(dim, seed):
    """Serving and every trainer compute an unseen id's vector; any bit of difference between
    the two forms would make a model score differently from where it was trained."""
    rng = np.random.default_rng(dim + seed)
    edges = np.array([0, -1, 1, 2**63 - 1, -(2**63)], dtype=np.int64)
    ids = np.concatenate([edges, rng.integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)])
    for std in (0.01, 0.3):
        assert torch.equal(initial_vectors(ids, dim, seed, std), initial_vectors_numpy(ids, dim, seed, std))
    assert initial_vectors(ids[:0], dim, seed, 0.01).shape == (0, dim)


def test_lookup_dedups_and_inits_unseen():
    table = EmbeddingTable(RamTier(3 * 4, 1 << 20), TableConfig(dim=4, seed=1))
    ids = np.array([[7, 8], [7, 7]], dtype=np.int64)
    lookup = table.lookup(ids)
    assert lookup.unique_ids.tolist() == [7, 8]
    assert lookup.inverse.tolist() == [0, 1, 0, 0]
    torch.testing.assert_close(lookup.vectors, initial_vectors(np.array([7, 8]), 4, 1, 0.01))
    assert len(table) == 0  # a lookup alone stores nothing


def test_sparse_adam_equals_torch_sparse_adam():
    """The table's row-wise Adam, over several steps with different touched rows, == torch.optim.SparseAdam."""
    dim, n = 4, 10
    cfg = TableConfig(dim=dim, seed=2, optim=SparseOptimConfig("adam", lr=0.05))
    table = EmbeddingTable(RamTier(3 * dim, 1 << 20), cfg)
    all_ids = np.arange(n, dtype=np.int64)
    reference = torch.nn.Embedding(n, dim, sparse=True)
    with torch.no_grad():
        reference.weight.copy_(initial_vectors(all_ids, dim, cfg.seed, cfg.init_std))
    opt = torch.optim.SparseAdam(
        reference.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps
    )
    rng = np.random.default_rng(0)
    target = torch.from_numpy(rng.normal(size=(n, dim)).astype(np.float32))
    for step in range(1, 8):
        batch = rng.choice(n, size=6)
        lookup = table.lookup(batch)
        leaf = lookup.vectors.detach().requires_grad_(True)
        loss = ((leaf[lookup.inverse] - target[batch]) ** 2).sum()
        loss.backward()
        table.update(lookup, leaf.grad, step)
        opt.zero_grad()
        ((reference(torch.from_numpy(batch)) - target[batch]) ** 2).sum().backward()
        opt.step()
    ids, rows = table.export()
    torch.testing.assert_close(rows[:, :dim], reference.weight.detach()[torch.from_numpy(ids)], rtol=1e-5, atol=1e-6)


def test_state_moves_with_the_row():
    table = EmbeddingTable(RamTier(3 * 2, 1 << 20), TableConfig(dim=2, optim=SparseOptimConfig("adam")))
    lookup = table.lookup(np.array([42], dtype=np.int64))
    table.update(lookup, torch.ones(1, 2), step=1)
    ids, rows = table.export()
    assert ids.tolist() == [42]
    assert (rows[0, 2:4] != 0).all() and (rows[0, 4:6] != 0).all()  # both moments stored in the row


def test_frozen_tier_reads_what_was_exported_and_refuses_writes(tier):
    """A snapshot's rows served from sorted arrays read exactly as the tier they came from."""
    ids = np.array([-(2**63), -5, 3, 9, 2**62 + 1], dtype=np.int64)
    tier.write(ids, torch.arange(len(ids) * WIDTH, dtype=torch.float32).view(-1, WIDTH))
    exported = np.sort(tier.all_ids())
    frozen = FrozenTier(exported, tier.read(exported)[0].cpu())
    probe = np.array([9, 4, -(2**63), 2**62 + 1, 2**63 - 1], dtype=np.int64)
    (want, want_found), (got, got_found) = tier.read(probe), frozen.read(probe)
    assert got_found.tolist() == want_found.tolist() == [True, False, True, True, False]
    torch.testing.assert_close(got, want.cpu())
    assert len(frozen) == len(ids) and isinstance(frozen, Tier)
    with pytest.raises(StoreError, match="frozen to training"):
        frozen.write(probe[:1], torch.zeros(1, WIDTH))
    with pytest.raises(StoreError, match="sorted"):
        FrozenTier(exported[::-1].copy(), torch.zeros(len(ids), WIDTH))


def test_frozen_tier_after_deltas_reads_as_a_tier_written_the_same_way():
    """Deltas applied in place (overwrites, new ids in the overlay, the overlay merged into the
    base, removals: tombstones that a later write revives) leave the frozen tier reading exactly
    as a RamTier given the same writes and removals."""
    rng = np.random.default_rng(3)
    base = np.unique(rng.integers(-1000, 1000, 300))
    reference = RamTier(WIDTH, 1 << 20)
    reference.write(base, torch.randn(len(base), WIDTH))
    frozen = FrozenTier(base, reference.read(base)[0].clone())
    for round_ in range(12):  # later rounds push the overlay past a quarter of the base: a merge
        ids = np.unique(rng.integers(-1500, 1500, 40 + 10 * round_))
        rows = torch.randn(len(ids), WIDTH)
        new = int((~reference.read(ids)[1]).sum())
        reference.write(ids, rows)
        shuffled = rng.permutation(len(ids))  # a delta's ids need not come sorted
        assert frozen.apply(ids[shuffled], rows[torch.from_numpy(shuffled)]) == new
        gone = np.unique(rng.integers(-1500, 1500, 15))  # expired rows: base, overlay, or never held
        assert frozen.remove(gone) == reference.remove(gone)
    probe = np.arange(-1600, 1600, dtype=np.int64)
    (want, want_found), (got, got_found) = reference.read(probe), frozen.read(probe)
    assert got_found.tolist() == want_found.tolist()
    torch.testing.assert_close(got, want.cpu())
    assert len(frozen) == len(reference) and frozen.all_ids().tolist() == np.sort(reference.all_ids()).tolist()
    assert len(frozen._arrays.base_ids) > len(base)  # the overlay was merged into the base at least once
    with pytest.raises(StoreError, match="width"):
        frozen.apply(np.array([1]), torch.zeros(1, WIDTH + 1))


@pytest.mark.parametrize("min_count", [1, 3])
def test_vectors_only_table_looks_up_as_the_training_table(min_count):
    """Serving's table (vectors only, over a FrozenTier) gives every id, held or unseen, the vector
    the training table gives it; it refuses to learn."""
    dim, fields = 3, 2
    config = TableConfig(dim=dim, seed=4, min_count=min_count)
    shared = np.array([1000, 1001], dtype=np.int64)
    train = EmbeddingTable(RamTier(3 * dim, 1 << 20), config, shared if min_count > 1 else None)
    rng = np.random.default_rng(0)
    for step in range(1, 6):
        batch = rng.integers(0, 12, size=(8, fields)).astype(np.int64)
        lookup = train.lookup(batch)
        train.update(lookup, torch.from_numpy(rng.normal(size=(len(lookup.unique_ids), dim)).astype(np.float32)), step)
    ids, rows = train.export()
    served = EmbeddingTable(FrozenTier(ids, rows[:, :dim].clone()), config, shared if min_count > 1 else None)
    probe = np.array([[0, 1], [5, 99], [98, 3], [11, 11]], dtype=np.int64)  # held and unseen ids
    a, b = train.lookup(probe), served.lookup(probe)
    torch.testing.assert_close(b.vectors[b.inverse], a.vectors[a.inverse])
    with pytest.raises(StoreError, match="vectors only"):
        served.update(b, torch.zeros(len(b.unique_ids), dim), 1)
    with pytest.raises(StoreError, match="tier width"):
        EmbeddingTable(RamTier(2 * dim, 1 << 20), config)


def test_ram_tier_reports_its_memory():
    tier = ram_tier()
    empty = tier.memory_bytes()
    tier.write(np.arange(100, dtype=np.int64), torch.zeros(100, WIDTH))
    grown = tier.memory_bytes()
    assert grown - empty >= 100 * WIDTH * 4  # at least the rows themselves
    assert grown < 100 * tier.row_bytes * 4  # and not wildly more than the budgeted figure
