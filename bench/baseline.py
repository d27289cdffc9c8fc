"""The baselines adstream is measured against.

- PlainTorch: what a competent PyTorch user would write, one of adstream's model heads (CtrModel)
  over a hashed nn.EmbeddingBag(sparse=True) table, SparseAdam for the table and Adam for the dense
  part. Two heads are used: `baseline_config` (a plain DeepFM of its own width: the accuracy
  baseline) and `like_for_like` (adstream's own model family and sizes: the speed baseline of
  `bench step` and `bench pipeline`, whose ratio then measures the store, the optimizers and the
  per-event machinery, not the model).
- online_lr: an online logistic regression (river, AdaGrad, one event at a time) on one-hot ids of
  the categorical fields, signed log1p integers and a flag per missing integer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from store.hashing import GOLDEN
from stream.featurizer.featurize import missing_id
from stream.records import FeatureBatch
from trainer.batch import Batch
from trainer.model import CtrModel, ModelConfig

_GOLDEN = GOLDEN


def hashed_rows(ids: np.ndarray, bits: int) -> torch.Tensor:
    """Feature ids -> rows of a 2^bits table (multiplicative hashing; collisions allowed)."""
    with np.errstate(over="ignore"):
        h = (ids.astype(np.uint64) * _GOLDEN) >> np.uint64(64 - bits)
    return torch.from_numpy(h.astype(np.int64))


BASELINE_EMBED_DIM = 8  # the plain DeepFM's own factor width, whatever adstream's default is


def baseline_config(ours: ModelConfig) -> ModelConfig:
    """The plain DeepFM's head for a stream adstream's model `ours` reads: same fields, its own width."""
    return replace(ours, kind="deepfm", dense_norm=False, embed_dim=BASELINE_EMBED_DIM, cross_rank=0)


def like_for_like(ours: ModelConfig) -> ModelConfig:
    """The plain loop's head for speed figures: adstream's model `ours` itself (family, width,
    cross and MLP sizes), without the online normalization of the dense floats."""
    return replace(ours, dense_norm=False)


class PlainTorch:
    def __init__(self, config: ModelConfig, table_bits: int = 21, lr: float = 0.001, sparse_lr: float = 0.01):
        self.config = config
        self.bits = table_bits
        self.embedding = nn.EmbeddingBag(1 << table_bits, config.row_dim, mode="sum", sparse=True)
        nn.init.normal_(self.embedding.weight, std=0.01)
        self.head = CtrModel(config)
        # plain: torch's default init for the MLP's output layer too (adstream's models start it at zero)
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        if hasattr(self.head, "mlp"):
            output = self.head.mlp[-1]
            assert isinstance(output, nn.Linear)
            output.reset_parameters()
        torch.random.set_rng_state(generator_state)
        self.sparse_opt = torch.optim.SparseAdam(self.embedding.parameters(), lr=sparse_lr)
        self.dense_opt = torch.optim.Adam(self.head.parameters(), lr=lr)

    def _logits(self, batch: Batch) -> torch.Tensor:
        rows = hashed_rows(batch.ids, self.bits).view(-1)
        offsets = torch.arange(0, rows.numel(), dtype=torch.int64)  # one id per bag
        emb = self.embedding(rows, offsets).view(len(batch), batch.ids.shape[1], -1)
        return self.head(emb, batch.dense)

    def train_step(self, batch: Batch) -> np.ndarray:
        logits = self._logits(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.sparse_opt.zero_grad()
        self.dense_opt.zero_grad()
        loss.backward()
        self.sparse_opt.step()
        self.dense_opt.step()
        return torch.sigmoid(logits.detach()).numpy()


def river_features(features: FeatureBatch) -> Iterator[dict[Any, float]]:
    """One river feature dict per event: a one-hot per sparse id of the categorical fields (the
    missing id included), signed log1p per present integer, a flag per missing integer."""
    d = features.dense.shape[1]
    ids = features.ids
    missing = ids[:, :d] == np.array([missing_id(j) for j in range(d)], dtype=np.int64)
    for i in range(len(ids)):
        x: dict[Any, float] = {}
        for j in range(d):
            if missing[i, j]:
                x[f"missing{j}"] = 1.0
            else:
                x[f"int{j}"] = float(features.dense[i, j])
        for key in ids[i, d:].tolist():
            x[key] = 1.0
        yield x


def online_lr(features: FeatureBatch, lr: float = 0.03) -> np.ndarray:
    """Progressive CTRs (n,) of river's LogisticRegression (AdaGrad `lr`), each event scored then learned."""
    from river import linear_model, optim

    model = linear_model.LogisticRegression(optimizer=optim.AdaGrad(lr))
    probs = np.empty(len(features))
    for i, (x, y) in enumerate(zip(river_features(features), features.labels.tolist(), strict=True)):
        probs[i] = model.predict_proba_one(x).get(True, 0.5)
        model.learn_one(x, bool(y))
    return probs
