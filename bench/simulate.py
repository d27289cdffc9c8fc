"""An ad server in a hidden world (bench/world.py), closing the loop through adstream's HTTP API.

Per request: k candidate ads for one context, scored with `POST /predict?shown=false`; the best
served CTR is shown (with probability epsilon a uniform pick instead: exploration), `POST /shown`
names it with its propensity; if the world says it is clicked, `POST /click` follows after the
world's delay. Meanwhile /model is polled (which version serves, the newest event it learned).

    AdServer.run(seconds) --> Trace (every shown impression, every new-campaign candidate, polls)
    report(trace, ...)    --> the figures: served AUC per version (against the world's clicks),
                              shown CTR against the truth-optimal choice, the new campaign's wait
                              until its served CTR is within 20% of its true CTR, freshness
    losses(trace, events-topic records) --> impressions and clicks lost or learned twice

The processes around it (joiner, featurizer, trainer, server, judge) are started by
adstream/simulate.py, or already run (compose).
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from bench.world import World
from trainer.metrics import auc_exact


@dataclass(frozen=True)
class Shown:
    """One impression the ad server showed."""

    t_s: float  # seconds into the run
    impression_id: str
    version: str  # the served version that scored it
    ctr: float  # its served CTR
    true_ctr: float  # the world's
    best_true_ctr: float  # the world's best among the candidates
    mean_true_ctr: float  # the candidates' mean (a random pick's expected CTR)
    clicked: bool  # the world's answer (the click is posted after its delay)
    new_campaign: bool
    propensity: float  # the chance this ad had of being chosen
    event: dict[str, Any]  # the event as scored (the oracle learns from it)


@dataclass
class Trace:
    shown: list[Shown] = field(default_factory=list)
    new_candidates: list[tuple[float, float, float]] = field(default_factory=list)  # (t_s, served, true)
    clicks: list[tuple[float, str]] = field(default_factory=list)  # (wall s when posted, impression id)
    polls: list[tuple[float, str, int, int]] = field(default_factory=list)  # (wall s, version, sequence, newest ms)
    failed_requests: int = 0  # /predict answered nothing (the server restarting)
    retried_posts: int = 0  # /shown or /click sent again after no answer


class AdServer:
    """The ad server's loop against `url`; `faults` maps seconds into the run to a callable."""

    def __init__(
        self,
        url: str,
        world: World,
        rate: float,
        candidates: int,
        epsilon: float,
        seed: int,
        token: str = "",
        faults: dict[float, Callable[[], None]] | None = None,
    ) -> None:
        import httpx

        self.url, self.world, self.rate, self.k, self.epsilon = url, world, rate, candidates, epsilon
        self.rng = np.random.default_rng(seed)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.Client(timeout=5.0, headers=headers)
        self.trace = Trace()
        self.faults = sorted((faults or {}).items())
        self._due: list[tuple[float, str, int]] = []  # (wall s to post, impression id, click ts ms)
        self._stop = threading.Event()
        self.tag = f"{seed:x}{int(time.time()) % 100000:05d}"

    def run(self, seconds: float, progress: Callable[[float], None] = lambda t: None) -> Trace:
        poller = threading.Thread(target=self._poll_model, daemon=True)
        poller.start()
        start = time.monotonic()
        n = 0
        try:
            while (t := time.monotonic() - start) < seconds:
                while self.faults and self.faults[0][0] <= t:
                    threading.Thread(target=self.faults.pop(0)[1], daemon=True).start()
                self._post_due_clicks()
                self._one_request(n, t)
                n += 1
                progress(t)
                pause = start + n / self.rate - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
            while self._due:  # every click the world decided is posted
                self._post_due_clicks()
                time.sleep(0.1)
        finally:
            self._stop.set()
            poller.join()
        return self.trace

    def _one_request(self, n: int, t: float) -> None:
        import httpx

        world, rng = self.world, self.rng
        world.advance(t)
        context = world.context(rng)
        ads = world.candidates(self.k, rng)
        ids = [f"sim{self.tag}-{n}-{j}" for j in range(len(ads))]
        events = world.events(context, ads, ids, int(time.time() * 1000), rng)
        try:
            response = self.client.post(f"{self.url}/predict?shown=false", content=orjson.dumps(events))
        except httpx.TransportError:
            self.trace.failed_requests += 1
            time.sleep(0.05)
            return
        if response.status_code != 200:
            self.trace.failed_requests += 1
            time.sleep(0.05)
            return
        answer = response.json()
        ctrs = np.array([p["ctr"] for p in answer["predictions"]])
        k = len(ads)
        best = int(np.argmax(ctrs))
        chosen = int(rng.integers(k)) if rng.random() < self.epsilon else best
        propensity = (1 - self.epsilon) * (chosen == best) + self.epsilon / k
        self._post("/shown", [{"impression_id": ids[chosen], "propensity": propensity}])
        truth = world.true_ctr(context, ads)
        new = world.is_new(ads)
        clicked = bool(rng.random() < truth[chosen])
        self.trace.shown.append(
            Shown(
                t,
                ids[chosen],
                answer["model_version"],
                float(ctrs[chosen]),
                float(truth[chosen]),
                float(truth.max()),
                float(truth.mean()),
                clicked,
                bool(new[chosen]),
                float(propensity),
                events[chosen],
            )
        )
        for j in np.nonzero(new)[0].tolist():
            self.trace.new_candidates.append((t, float(ctrs[j]), float(truth[j])))
        if clicked:
            delay = world.click_delay_s(rng)
            now = time.time()
            heapq.heappush(self._due, (now + delay, ids[chosen], int((now + delay) * 1000)))

    def _post_due_clicks(self) -> None:
        now = time.time()
        batch = []
        while self._due and self._due[0][0] <= now:
            _, impression_id, ts = heapq.heappop(self._due)
            batch.append({"impression_id": impression_id, "ts": ts})
        if batch:
            self._post("/click", batch)
            self.trace.clicks.extend((time.time(), str(c["impression_id"])) for c in batch)

    def _post(self, path: str, body: list[dict[str, Any]]) -> None:
        """Until the server takes it (a restart in between: its held candidates come back with it)."""
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                response = self.client.post(f"{self.url}{path}", content=orjson.dumps(body))
                if response.status_code == 200:
                    return
                if response.status_code < 500:
                    raise RuntimeError(f"simulate: {path} refused: {response.status_code} {response.text[:300]}")
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"simulate: {path} got no answer for 120 s")
            self.trace.retried_posts += 1
            time.sleep(0.1)

    def _poll_model(self) -> None:
        import httpx

        while not self._stop.is_set():
            try:
                info = self.client.get(f"{self.url}/model").json()
                if "model_version" in info:
                    polled = (time.time(), info["model_version"], info["sequence"], info["newest_event_ms"])
                    self.trace.polls.append(polled)
            except (httpx.HTTPError, ValueError):
                pass
            self._stop.wait(0.1)


def report(trace: Trace, world: World, bucket_s: float = 10.0) -> dict[str, Any]:
    """What the run shows, from the ad server's side (the world's own clicks as labels)."""
    shown = trace.shown
    t = np.array([s.t_s for s in shown])
    versions: dict[str, list[Shown]] = {}
    for s in shown:
        versions.setdefault(s.version, []).append(s)
    per_version = {
        v: {
            "impressions": len(rows),
            "from_s": rows[0].t_s,
            "served_auc": auc_exact(np.array([r.clicked for r in rows]), np.array([r.ctr for r in rows])),
            "true_auc": auc_exact(np.array([r.clicked for r in rows]), np.array([r.true_ctr for r in rows])),
            "mean_served_ctr": float(np.mean([r.ctr for r in rows])),
            "mean_true_ctr": float(np.mean([r.true_ctr for r in rows])),
        }
        for v, rows in versions.items()
    }
    buckets = []
    for lo in np.arange(0, t.max() + bucket_s if len(t) else 0, bucket_s):
        rows = [s for s in shown if lo <= s.t_s < lo + bucket_s]
        if rows:
            buckets.append(
                {
                    "t_s": float(lo),
                    "shown_true_ctr": float(np.mean([r.true_ctr for r in rows])),
                    "optimal_true_ctr": float(np.mean([r.best_true_ctr for r in rows])),
                    "random_true_ctr": float(np.mean([r.mean_true_ctr for r in rows])),
                    "clicks": int(sum(r.clicked for r in rows)),
                }
            )
    last = [s for s in shown if s.t_s >= 2 * t.max() / 3] if len(t) else []
    return {
        "impressions": len(shown),
        "clicks": int(sum(s.clicked for s in shown)),
        # the last third of the run: the true CTR of what was shown, of the truth-optimal choice, of a random one
        "last_third_ctr": {
            "shown": float(np.mean([s.true_ctr for s in last])) if last else float("nan"),
            "optimal": float(np.mean([s.best_true_ctr for s in last])) if last else float("nan"),
            "random": float(np.mean([s.mean_true_ctr for s in last])) if last else float("nan"),
        },
        "failed_requests": trace.failed_requests,
        "retried_posts": trace.retried_posts,
        "versions": per_version,
        "over_time": buckets,
        "new_campaign": new_campaign(trace, world),
        "freshness": freshness(trace),
    }


def new_campaign(trace: Trace, world: World, bucket_s: float = 5.0) -> dict[str, Any]:
    """How long the new campaign waits until the served CTR of its ads is within 20% of the truth
    (mean over its candidates in a bucket, and in the two buckets after), and its share of traffic."""
    launch = world.config.new_campaign_at_s
    rows = np.array(trace.new_candidates) if trace.new_candidates else np.zeros((0, 3))
    series = []
    for lo in np.arange(launch, rows[:, 0].max() + bucket_s if len(rows) else launch, bucket_s):
        inside = rows[(rows[:, 0] >= lo) & (rows[:, 0] < lo + bucket_s)]
        if len(inside):
            series.append((float(lo - launch), float(inside[:, 1].mean()), float(inside[:, 2].mean())))
    within = [abs(served / true - 1) <= 0.2 for _, served, true in series]
    wait = next((series[i][0] for i in range(len(series)) if all(within[i : i + 3])), None)
    after = [s for s in trace.shown if s.t_s >= launch]
    return {
        "launch_s": launch,
        "within_20pct_after_s": wait,
        "traffic_share": float(np.mean([s.new_campaign for s in after])) if after else 0.0,
        "series": [{"after_s": a, "served_ctr": s, "true_ctr": tr} for a, s, tr in series],
    }


def freshness(trace: Trace) -> dict[str, Any]:
    """Click -> served: from a click's post to the first poll whose served model learned an
    impression served after it (newest event time >= the post)."""
    polls = sorted(trace.polls)
    waits = []
    j = 0
    for posted, _ in sorted(trace.clicks):
        while j < len(polls) and polls[j][0] < posted:
            j += 1
        k = next((i for i in range(j, len(polls)) if polls[i][3] >= posted * 1000), None)
        if k is not None:
            waits.append(polls[k][0] - posted)
    if not waits:
        return {"clicks": 0}
    return {
        "clicks": len(waits),
        "p50_s": float(np.percentile(waits, 50)),
        "p99_s": float(np.percentile(waits, 99)),
    }


def losses(trace: Trace, records: list[bytes], label_field: str, id_field: str) -> dict[str, int]:
    """Against the joiner's output: every shown impression once (labelled 0 under fake_negative),
    every click once (its positive copy), nothing else of ours."""
    from stream.join.outputs import read_events

    firsts: dict[str, int] = {}
    copies: dict[str, int] = {}
    for value in records:
        for event in read_events(value):
            key = str(event.get(id_field))
            if not key.startswith("sim"):
                continue
            bucket = copies if event.get(label_field) == 1 else firsts
            bucket[key] = bucket.get(key, 0) + 1
    shown = {s.impression_id for s in trace.shown}
    clicked = {i for _, i in trace.clicks}
    return {
        "impressions_shown": len(shown),
        "impressions_lost": len(shown - set(firsts)),
        "impressions_twice": sum(1 for i in shown if firsts.get(i, 0) > 1),
        "impressions_unknown": len(set(firsts) - shown),
        "clicks_posted": len(clicked),
        "clicks_lost": len(clicked - set(copies)),
        "clicks_twice": sum(1 for i in clicked if copies.get(i, 0) > 1),
    }


def oracle_auc(
    trace: Trace, schema: Any, trainer_settings: Any, since_s: float, history: list[dict[str, Any]]
) -> dict[str, float]:
    """A trainer fed what the pipeline learned from (the history, then each shown impression) with
    the true clicks at once (no delay, no loop), in order, scoring each shown impression before it
    learns it; its AUC and the served AUC on the impressions after since_s. `history`: labelled
    events."""
    import torch

    from stream.featurizer.decode import event_from_mapping
    from stream.featurizer.featurize import featurize
    from trainer.batch import batch_from_features
    from trainer.trainer import Trainer

    torch.manual_seed(0)
    trainer = Trainer(schema, trainer_settings)
    shown = trace.shown
    scores = np.zeros(len(shown))
    size = trainer_settings.batch_size
    for start in range(0, len(history), size):
        events = [event_from_mapping(e, schema) for e in history[start : start + size]]
        trainer.learn(batch_from_features([featurize(events, schema)]))
    for start in range(0, len(shown), size):
        rows = shown[start : start + size]
        events = [event_from_mapping({**r.event, schema.label: int(r.clicked)}, schema) for r in rows]
        batch = batch_from_features([featurize(events, schema)])
        scores[start : start + len(rows)] = trainer.predict(batch)
        trainer.learn(batch)
    late = np.array([s.t_s >= since_s for s in shown])
    labels = np.array([s.clicked for s in shown])[late]
    return {
        "since_s": since_s,
        "impressions": int(late.sum()),
        "oracle_auc": auc_exact(labels, scores[late]),
        "served_auc": auc_exact(labels, np.array([s.ctr for s in shown])[late]),
        "true_auc": auc_exact(labels, np.array([s.true_ctr for s in shown])[late]),
    }
