"""Criteo-shaped synthetic events with a known ground-truth CTR model.

Categories are Zipf-distributed per field; labels are Bernoulli(sigmoid(logit)) with
    logit = bias + sum_f w_f[value_f] + sum_{f<g in K} <v_f[value_f], v_g[value_g]> + sum_j b_j x_j
(per-value weights, factorized pairwise interactions among K fields, dense effects), so the best
reachable AUC is that of the true probabilities. An optional random walk of the weights (drift)
makes a model that stops learning fall measurably behind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stream.errors import StreamError
from stream.schema import Schema


@dataclass(frozen=True)
class SyntheticConfig:
    seed: int = 7  # same seed, same stream
    zipf_exponent: float = 1.15  # popularity skew of category values
    vocab_min: int = 4  # smallest category vocabulary
    vocab_max: int = 1000  # largest category vocabulary
    weight_std: float = 0.5  # spread of per-value weights
    factor_dim: int = 4  # width of interaction factors
    factor_std: float = 0.3  # spread of interaction factors
    interacting_fields: int = 6  # number of categorical fields that interact pairwise
    dense_weight_std: float = 0.15  # spread of dense effects (per log-count)
    base_ctr: float = 0.25  # roughly the positive rate
    drift_per_million: float = 0.0  # std of the weights' random walk per million events
    start_ms: int = 1_700_000_000_000  # timestamp of the first event
    list_vocab: int = 300  # values of each list field (schemas with list_fields only)
    list_mean_values: float = 2.5  # mean values per event per list field (Poisson; 0 values = missing)
    list_weight_std: float = 1.0  # spread of list values' weights; an event gets the mean of its values'


class SyntheticCriteo:
    """A seeded event generator; `generate(n)` continues the stream where it left off."""

    def __init__(self, schema: Schema, config: SyntheticConfig = SyntheticConfig()) -> None:
        if schema.categorical_encoding != "hex32":
            raise StreamError(
                f'synthetic: schema {schema.name} must use hex32 categories (categorical_encoding = "hex32")'
            )
        self.schema = schema
        self.config = config
        rng = np.random.default_rng(config.seed)
        self._rng = np.random.default_rng(config.seed + 1)
        n_cat = len(schema.categorical_fields)
        n_int = len(schema.integer_fields)
        self.vocab = np.geomspace(config.vocab_min, config.vocab_max, n_cat).astype(np.int64)
        rng.shuffle(self.vocab)
        self._cdf = []
        self.values = []
        self.weights = []
        importance = rng.choice([0.0, 0.5, 1.0], size=n_cat, p=[0.25, 0.35, 0.4])
        for f in range(n_cat):
            ranks = np.arange(1, self.vocab[f] + 1, dtype=np.float64)
            p = ranks**-config.zipf_exponent
            self._cdf.append(np.cumsum(p / p.sum()))
            values = rng.integers(0, 1 << 32, size=self.vocab[f], dtype=np.int64)
            self.values.append(np.array([f"{v:08x}" for v in values], dtype=object))
            self.weights.append(rng.normal(0.0, config.weight_std * importance[f], self.vocab[f]))
        k = min(config.interacting_fields, n_cat)
        self.interacting = list(range(k))  # categorical fields that interact pairwise
        self.factors = [rng.normal(0.0, config.factor_std, (self.vocab[f], config.factor_dim)) for f in range(k)]
        self.cat_missing = rng.choice([0.0, 0.05, 0.4], size=n_cat, p=[0.6, 0.25, 0.15])
        self.int_missing = rng.choice([0.0, 0.2, 0.45], size=n_int, p=[0.5, 0.3, 0.2])
        self.int_scale = rng.uniform(0.5, 4.0, n_int)
        self.dense_weights = rng.normal(0.0, config.dense_weight_std, n_int)
        self.bias = float(np.log(config.base_ctr / (1 - config.base_ctr)))
        self.produced = 0
        # list fields draw from their own generator, so a schema without them gets the same stream
        lists = np.random.default_rng(config.seed + 2)
        self._list_rng = np.random.default_rng(config.seed + 3)
        self.list_values = [
            np.array([f"{v:08x}" for v in lists.integers(0, 1 << 32, config.list_vocab)], dtype=object)
            for _ in schema.list_fields
        ]
        self.list_weights = [lists.normal(0.0, config.list_weight_std, config.list_vocab) for _ in schema.list_fields]

    def generate(self, n: int) -> tuple[list[dict[str, object]], np.ndarray]:
        """n events (JSON-ready dicts, labelled) and their true click probabilities (n,)."""
        cfg, rng, schema = self.config, self._rng, self.schema
        self._drift(n)
        ranks = [np.searchsorted(cdf, rng.random(n)).clip(max=len(cdf) - 1) for cdf in self._cdf]
        cat_missing = [rng.random(n) < m for m in self.cat_missing]
        logit = np.full(n, self.bias)
        for f, r in enumerate(ranks):
            logit += np.where(cat_missing[f], 0.0, self.weights[f][r])
        inter = np.zeros((n, cfg.factor_dim))
        square = np.zeros(n)
        for i, f in enumerate(self.interacting):
            v = np.where(cat_missing[f][:, None], 0.0, self.factors[i][ranks[f]])
            inter += v
            square += (v * v).sum(1)
        logit += 0.5 * ((inter * inter).sum(1) - square)
        counts = np.floor(np.exp(rng.normal(0.0, 1.0, (n, len(self.int_scale))) * self.int_scale)).astype(np.int64) - 1
        int_missing = rng.random(counts.shape) < self.int_missing
        dense = np.sign(counts) * np.log1p(np.abs(counts))  # = featurize.signed_log1p
        logit += np.where(int_missing, 0.0, dense - dense.mean()) @ self.dense_weights
        lists = self._lists(n, logit)
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < p).astype(np.int64)
        events = []
        hexes = [np.where(cat_missing[f], None, self.values[f][r]).tolist() for f, r in enumerate(ranks)]  # type: ignore[call-overload,attr-defined]
        ints = np.where(int_missing, None, counts.astype(object)).tolist()  # type: ignore[call-overload]
        int_names = schema.integer_fields
        cat_names = schema.categorical_fields
        for row in range(n):
            seq = self.produced + row
            event: dict[str, object] = {
                schema.event_id: f"syn-{cfg.seed}-{seq}",
                schema.timestamp: cfg.start_ms + seq,
                schema.label: int(labels[row]),
            }
            event.update(zip(int_names, ints[row]))
            event.update((name, hexes[f][row]) for f, name in enumerate(cat_names))
            event.update((name, lists[j][row]) for j, name in enumerate(schema.list_fields))
            events.append(event)
        self.produced += n
        return events, p

    def _lists(self, n: int, logit: np.ndarray) -> list[list[list[str]]]:
        """Each list field's values per event (Zipf over its vocabulary); adds the mean of their
        weights to `logit` in place (what mean pooling can learn)."""
        out = []
        cfg, rng = self.config, self._list_rng
        ranks = np.arange(1, cfg.list_vocab + 1, dtype=np.float64) ** -cfg.zipf_exponent
        cdf = np.cumsum(ranks / ranks.sum())
        for values, weights in zip(self.list_values, self.list_weights, strict=True):
            counts = np.minimum(rng.poisson(cfg.list_mean_values, n), 16)
            picks = np.searchsorted(cdf, rng.random(int(counts.sum()))).clip(max=cfg.list_vocab - 1)
            starts = np.concatenate([[0], np.cumsum(counts)])
            sums = np.bincount(np.repeat(np.arange(n), counts), weights=weights[picks], minlength=n)
            logit += np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
            names = values[picks].tolist()
            out.append([names[starts[i] : starts[i + 1]] for i in range(n)])
        return out

    def _drift(self, n: int) -> None:
        if self.config.drift_per_million <= 0:
            return
        std = self.config.drift_per_million * np.sqrt(n / 1e6)
        for w in self.weights:
            w += self._rng.normal(0.0, std, w.shape)
