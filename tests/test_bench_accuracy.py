"""`adstream bench accuracy` keeps its JSON contract (tiny streams; the figures are not tested,
except that the truth is the ceiling it should be and that freezing a model stops it learning)."""

from bench.accuracy import run_accuracy_bench
from stream.schema import load_schema
from tests.helpers import CRITEO_DIR, CRITEO_FILES, needs_shared
from trainer.settings import ModelSettings, TrainerSettings


@needs_shared(bool(CRITEO_FILES), "the real Criteo rows")
def test_bench_accuracy_reports_every_dataset_and_model():
    settings = TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), threads=1)
    result = run_accuracy_bench(
        load_schema("criteo"),
        settings,
        events=20_000,
        drift=2.0,
        criteo_dir=str(CRITEO_DIR),
        ablation=False,
        progress=False,
    )
    runs = result["runs"]
    for run in runs:
        assert {"dataset", "model", "auc", "logloss", "ece", "samples_per_s", "truth_auc"} <= run.keys()
        assert 0.0 <= run["auc"] <= 1.0 and 0.0 <= run["ece"] <= 1.0 and run["samples_per_s"] > 0
    pairs = {(r["dataset"], r["model"]) for r in runs}
    real = ("criteo-real", "criteo-real/first-half", "criteo-real/second-half")
    for dataset in (*real, "synthetic", "synthetic-drift2"):
        families = [f"adstream-{kind}" for kind in ("lr", "fm", "deepfm", "dcn") if kind != settings.model.kind]
        for model in ("adstream", *families, "river-lr", "pytorch-deepfm"):
            if dataset.startswith("synthetic-drift") and model not in ("adstream", "river-lr"):
                continue
            assert (dataset, model) in pairs, (dataset, model)
    assert ("synthetic", "adstream-b4096-cowclip") in pairs
    synthetic = [r for r in runs if r["dataset"].startswith("synthetic")]
    assert all(r["truth_auc"] > r["auc"] for r in synthetic)  # nothing beats the true probabilities
    assert all(r["truth_auc"] is None for r in runs if r["dataset"].startswith("criteo"))
    drift = {r["model"]: r for r in runs if r["dataset"] == "synthetic-drift2"}
    assert drift["adstream-frozen-at-20%"]["auc"] < drift["adstream"]["auc"]
    assert any(key.startswith("criteo-real/second-half") for key in result["targets"])
    # the champion of the default challengers, beside each member; the default member is the lone
    # default model exactly (the same batches, the same learner)
    for dataset in ("criteo-real", "synthetic", "synthetic-drift2"):
        rows = {r["model"]: r for r in runs if r["dataset"] == dataset}
        assert rows["member: default"]["auc"] == rows["adstream"]["auc"]
        assert rows["member: default"]["logloss"] == rows["adstream"]["logloss"]
        champion = rows["adstream-champion"]
        assert tuple(champion["switches"][0]) == (0, "default")
        served = {name for _, name in champion["switches"]}
        assert served <= {"default", *settings.challengers}  # (a member the budget stopped may have served before)
        assert f"{dataset}: champion auc >= online LR" in result["targets"]
        assert f"{dataset}: champion auc >= best member - 0.002" in result["targets"]


def test_bench_accuracy_takes_any_log_its_schema_reads(tmp_path):
    """#29 item 11: `--criteo` globbed *.txt only and the synthetic jobs failed under avazu (exit 2,
    no JSON); a log of any schema is the real rows, named by the schema, and the synthetic datasets
    are skipped with the reason when the generator cannot drive the schema."""
    from tests.helpers import avazu_csv

    log = avazu_csv(tmp_path / "avazu.csv", 3000)
    settings = TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), threads=1)
    result = run_accuracy_bench(
        load_schema("avazu"), settings, events=2000, logs=[str(log)], ablation=False, progress=False
    )
    datasets = {r["dataset"] for r in result["runs"]}
    assert datasets == {"avazu-log", "avazu-log/first-half", "avazu-log/second-half"}
    assert {"adstream", "adstream-champion", "river-lr", "pytorch-deepfm"} <= {r["model"] for r in result["runs"]}
    assert "avazu-log: champion auc >= online LR" in result["targets"]
    assert result["synthetic"].startswith("skipped: the synthetic generator cannot drive schema 'avazu'")
    assert any(key.startswith("avazu-log/second-half") for key in result["targets"])
