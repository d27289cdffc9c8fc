"""`adstream bench merge` keeps its JSON contract (a tiny grid; the speed figures themselves are not
tested; that sharded rows give the synchronous model is)."""

from bench.merge import run_merge_bench


def test_bench_merge_reports_every_run_of_the_grid(tmp_path):
    result = run_merge_bench(
        events=6000, criteo_dir=str(tmp_path / "none"), batch_size=500, workers=(1, 2), ks=(1, 16), progress=False
    )
    grid = {(r["dataset"], r["workers"], r["k"], r["layout"]) for r in result["runs"]}
    assert grid == {
        ("synthetic", 1, 1, "replicated"),
        ("synthetic", 1, 0, "replicated"),
        ("synthetic", 2, 1, "replicated"),
        ("synthetic", 2, 16, "replicated"),
        ("synthetic", 2, 0, "replicated"),
        ("synthetic", 2, 0, "sharded"),
    }
    for run in result["runs"]:
        assert {"dataset", "workers", "k", "auc", "logloss", "bytes", "wall_s", "samples_per_s"} <= run.keys()
        assert 0.0 <= run["auc"] <= 1.0 and run["samples_per_s"] > 0
        assert 0.0 <= run["window_auc"] <= 1.0 and len(run["auc_by_tenth"]) == 10
        assert 0.0 <= run["served_auc"] <= 1.0  # every layout of this grid keeps a served view
        assert (run["bytes"] > 0) == (run["workers"] > 1)  # one worker sends nothing
    by_k = {r["k"]: r for r in result["runs"] if r["workers"] == 2 and r["layout"] == "replicated"}
    assert by_k[1]["bytes"] > by_k[16]["bytes"]  # merging less often sends less
    rounds = 6000 // 500 // 2
    # 6 rounds: k = 1 merges after each, k = 16 only when the stream ends, synchronous never
    assert (by_k[1]["merges"], by_k[16]["merges"], by_k[0]["merges"]) == (rounds, 1, 0)
    (check,) = result["checks"]
    assert check["bytes_k1_over_k16"] == by_k[1]["bytes"] / by_k[16]["bytes"]
    assert check["bytes_sync_over_k16"] == by_k[0]["bytes"] / by_k[16]["bytes"]
    # sharded rows: the same synchronous model as replicated rows, each replica holding part of them
    (sharded,) = [r for r in result["runs"] if r["layout"] == "sharded"]
    assert abs(check["sharded_auc_minus_sync"]) < 1e-4
    assert sum(sharded["rows_per_replica"]) == max(by_k[0]["rows_per_replica"])  # each row on exactly one owner
    assert check["sharded_rows_per_replica_over_sync"] < 0.7


def test_the_replicas_scores_go_back_in_stream_order():
    """Batch i went to replica i mod N: the window (the stream's last 20%) is taken after the
    replicas' per-event arrays are interleaved back by batch number."""
    import numpy as np

    from bench.merge import _in_stream_order

    replicas = [  # 2 replicas, batches of 2 events then 1: batch numbers 0, 2 on replica 0; 1, 3 on 1
        {"batch_of": np.array([0, 0, 2]), "probs": np.array([0.0, 1.0, 4.0])},
        {"batch_of": np.array([1, 1, 3]), "probs": np.array([2.0, 3.0, 5.0])},
    ]
    assert _in_stream_order(replicas, "probs").tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_several_seeds_are_averaged_and_the_checks_taken_on_the_mean(tmp_path):
    result = run_merge_bench(
        events=6000,
        criteo_dir=str(tmp_path / "none"),
        batch_size=500,
        workers=(2,),
        ks=(1, 16),
        progress=False,
        seeds=2,
    )
    assert sorted({r["seed"] for r in result["runs"]}) == [0, 1] and len(result["runs"]) == 2 * 4
    means = {(r["k"], r["layout"]): r for r in result["mean_runs"]}
    assert len(means) == 4 and all(r["seeds"] == 2 for r in means.values())
    k16 = [r for r in result["runs"] if r["k"] == 16]
    assert k16[0]["window_auc"] != k16[1]["window_auc"]  # the seed reached the trainers
    assert means[16, "replicated"]["window_auc"] == sum(r["window_auc"] for r in k16) / 2
    assert means[16, "replicated"]["window_auc_seed_std"] > 0
    (check,) = result["checks"]
    assert (
        check["window_auc_k16_minus_k1"] == means[16, "replicated"]["window_auc"] - means[1, "replicated"]["window_auc"]
    )
