"""A picture beside each benchmark's JSON (`adstream bench X --json PATH` also writes PATH's .png).

    accuracy: AUC over the stream (each tenth of it), one line per model and dataset; below, which
              member served the champion's row when
    serving:  latency CDF per load (1 and 64 events per request, ours and mlflow pyfunc),
              and the freshness histogram
    merge:    AUC over the stream for k = 1, 16, 64 and sync at 4 and 8 workers; window AUC against bytes
    store:    rows/s of each store (the in-RAM table, the hierarchy cold, warm and serial)
    join:     AUC per policy and window, and the joiner's impressions/s
    simulate: served AUC per version, shown vs optimal CTR, the new campaign, freshness (not a bench:
              `adstream simulate --json PATH`)
Other benchmarks draw nothing. Drawn from the JSON alone, with matplotlib's file backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_bench(which: str, result: dict[str, Any], png: Path) -> Path | None:
    """Draw `result` of bench `which` into `png`; None when the bench has no picture."""
    draw = {
        "accuracy": _accuracy,
        "serving": _serving,
        "merge": _merge,
        "store": _store,
        "join": _join,
        "simulate": _simulate,
    }.get(which)
    if draw is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = draw(plt, result)
    figure.tight_layout()
    figure.savefig(png, dpi=110)
    plt.close(figure)
    return png


def _accuracy(plt: Any, result: dict[str, Any]) -> Any:
    runs = [
        r for r in result["runs"] if r.get("auc_by_tenth") and "ablation" not in r["model"] and "/" not in r["dataset"]
    ]
    datasets = sorted({r["dataset"] for r in runs})
    columns = max(len(datasets), 1)
    figure, axes = plt.subplots(2, columns, figsize=(5.5 * columns, 6.5), squeeze=False, height_ratios=(3, 1))
    for ax, served_ax, dataset in zip(axes[0], axes[1], datasets, strict=False):
        for r in (r for r in runs if r["dataset"] == dataset):
            tenths = r["auc_by_tenth"]
            ax.plot([10 * (i + 1) for i in range(len(tenths))], tenths, marker=".", label=r["model"])
        ax.set(title=dataset, xlabel="% of the stream", ylabel="AUC of each tenth (scored before learning)")
        ax.legend(fontsize=6)
        _served_when(served_ax, next((r for r in runs if r["dataset"] == dataset and r.get("switches")), None))
    return figure


def _served_when(ax: Any, champion: dict[str, Any] | None) -> None:
    """Which member served the champion's row, from which % of the stream on (bench accuracy's `switches`)."""
    if champion is None:
        ax.set_axis_off()
        return
    switches = champion["switches"]
    names = list(dict.fromkeys(name for _, name in switches))
    x = [100 * at / champion["events"] for at, _ in switches] + [100.0]
    y = [names.index(name) for _, name in switches]
    ax.step(x, [*y, y[-1]], where="post")
    ax.set_yticks(range(len(names)), [n if len(n) < 28 else n[:25] + "..." for n in names], fontsize=6)
    ax.set(xlabel="% of the stream", title="served by (the champion)", xlim=(0, 100))


def _serving(plt: Any, result: dict[str, Any]) -> Any:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, load in result.items():
        if isinstance(load, dict) and load.get("cdf_ms"):
            quantiles = sorted((float(q), ms) for q, ms in load["cdf_ms"].items())
            left.plot([ms for _, ms in quantiles], [q for q, _ in quantiles], label=name)
    left.set(xscale="log", xlabel="latency (ms)", ylabel="% of requests at most", title="POST /predict latency CDF")
    left.legend(fontsize=7)
    histogram = result.get("freshness", {}).get("histogram_s")
    if histogram:
        edges, counts = histogram["edges"], histogram["counts"]
        right.bar(edges[:-1], counts, width=[b - a for a, b in zip(edges, edges[1:], strict=False)], align="edge")
    right.set(xlabel="seconds from an event produced to a served model that learned it", ylabel="events")
    right.set_title("freshness")
    return figure


def _merge(plt: Any, result: dict[str, Any]) -> Any:
    """One panel per worker count of 4 and more (of the synthetic stream): the AUC of each tenth of
    the stream for k = 1, 16, 64 and synchronous; then window AUC against bytes for every run."""
    every = result.get("mean_runs") or result["runs"]  # with several seeds: their mean per configuration
    runs = [r for r in every if r.get("dataset", "synthetic") == "synthetic"]
    counts = sorted({r["workers"] for r in runs if r["workers"] >= 4}) or sorted({r["workers"] for r in runs})
    figure, axes = plt.subplots(1, len(counts) + 1, figsize=(5 * (len(counts) + 1), 4), squeeze=False)
    for ax, workers in zip(axes[0], counts, strict=False):
        for r in runs:
            if r["workers"] == workers and r.get("layout", "replicated") == "replicated" and r.get("auc_by_tenth"):
                tenths = r["auc_by_tenth"]
                label = "sync" if r["k"] == 0 else f"k={r['k']}"
                ax.plot([10 * (i + 1) for i in range(len(tenths))], tenths, marker=".", label=label)
        ax.set(
            title=f"{workers} workers", xlabel="% of the stream", ylabel="AUC of each tenth (scored before learning)"
        )
        ax.legend(fontsize=7)
    scatter = axes[0][-1]
    for r in runs:
        if r["workers"] == 1:  # nothing sent
            continue
        auc, layout = r.get("window_auc", r["auc"]), r.get("layout", "replicated")
        kind = "sync" if r["k"] == 0 else f"k={r['k']}"
        label = f"{r['workers']}w {kind}" + ("" if layout == "replicated" else f" {layout}")
        scatter.scatter(r["bytes"], auc, color=f"C{counts.index(r['workers']) if r['workers'] in counts else 9}")
        scatter.annotate(label, (r["bytes"], auc), fontsize=6)
    scatter.set(xscale="log", xlabel="bytes the replicas sent (merges or syncs)", ylabel="window AUC (last 20%)")
    scatter.set_title("synthetic: window AUC against bytes")
    return figure


def _store(plt: Any, result: dict[str, Any]) -> Any:
    bars = {
        "in-RAM table": result.get("in_memory_rows_per_s"),
        "hierarchy, cold": result.get("hierarchy_cold_rows_per_s"),
        "hierarchy, warm": result.get("hierarchy_rows_per_s"),
        "hierarchy, no prefetch": result.get("hierarchy_serial_rows_per_s"),
    }
    bars = {k: v for k, v in bars.items() if v}
    figure, ax = plt.subplots(figsize=(7, 4))
    ax.bar(list(bars), list(bars.values()))
    ax.set(ylabel="rows/s", title="embedding rows looked up and updated per second")
    return figure


def _join(plt: Any, result: dict[str, Any]) -> Any:
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    runs = result.get("accuracy", [])
    labels = [r["policy"] + ("" if r["window_s"] is None else f"\n{r['window_s'] / 60:g} min") for r in runs]
    left.bar(range(len(runs)), [r["auc"] for r in runs])
    left.set_xticks(range(len(runs)), labels, fontsize=7, rotation=30, ha="right")
    if runs:
        low = min(r["auc"] for r in runs)
        left.set_ylim(low - 0.01, max(r["auc"] for r in runs) + 0.005)
    left.set(ylabel="AUC against the true labels", title="learning from delayed clicks")
    joiner = result.get("joiner", [])
    right.bar(
        [f"{j['format']} x{j['bundle']}\n{j.get('window_s') or 0:g} s window" for j in joiner],
        [j["impressions_per_s"] for j in joiner],
    )
    right.set(ylabel="impressions/s", title="the joiner, one process")
    return figure


def _simulate(plt: Any, result: dict[str, Any]) -> Any:
    figure, ((auc, ctr), (new, fresh)) = plt.subplots(2, 2, figsize=(11, 7))
    versions = sorted(result["versions"].items(), key=lambda kv: kv[1]["from_s"])
    starts = [v["from_s"] for _, v in versions]
    auc.step(starts, [v["served_auc"] for _, v in versions], where="post", label="served (the world's clicks)")
    auc.step(starts, [v["true_auc"] for _, v in versions], where="post", label="the true CTRs")
    judge = result.get("judge", {}).get("versions", {})
    joined = [(result["versions"][k]["from_s"], v["auc"]) for k, v in judge.items() if k in result["versions"]]
    if joined:
        auc.scatter(*zip(*sorted(joined)), s=12, color="k", label="judge (joined labels)")
    auc.set(xlabel="seconds into the run", ylabel="AUC of the shown ads", title="each served version")
    auc.legend(fontsize=7)
    rows = result["over_time"]
    t = [r["t_s"] for r in rows]
    for key, label in (
        ("optimal_true_ctr", "truth-optimal"),
        ("shown_true_ctr", "shown"),
        ("random_true_ctr", "random"),
    ):
        ctr.plot(t, [r[key] for r in rows], label=label)
    ctr.set(xlabel="seconds into the run", ylabel="true CTR of the ad", title="what the ad server showed")
    ctr.legend(fontsize=7)
    series = result["new_campaign"]["series"]
    new.plot([s["after_s"] for s in series], [s["served_ctr"] for s in series], label="served")
    new.plot([s["after_s"] for s in series], [s["true_ctr"] for s in series], label="true")
    new.set(xlabel="seconds after the launch", ylabel="mean CTR of its candidates", title="the new campaign")
    new.legend(fontsize=7)
    f = result["freshness"]
    fresh.bar(["p50", "p99"], [f.get("p50_s", 0), f.get("p99_s", 0)])
    fresh.set(ylabel="seconds", title="click posted -> a served version learned past it")
    return figure
