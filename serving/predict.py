"""Events -> CTRs with a ServedModel. Pure; featurizes with the very code the stream uses, reads
rows with the trainer's own lookup (trainer.step.model_inputs) and scores with the served
network's numpy form (serving/scorer.py: the trainer's forward without torch's per-op cost)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from serving.loader import ServedModel
from serving.scorer import score
from stream.featurizer.featurize import featurize
from stream.records import Event
from stream.schema import Schema
from trainer.batch import batch_from_features
from trainer.step import model_inputs


def predict_events(served: ServedModel, events: Sequence[Event], schema: Schema) -> np.ndarray:
    """CTR per event, float32 (n,)."""
    if not events:
        return np.zeros(0, dtype=np.float32)
    batch = batch_from_features([featurize(events, schema)])
    with torch.inference_mode():
        rows, _, _ = model_inputs(served.model, served.table, batch)
    return score(served.scorer, rows.numpy(), batch.dense.numpy())
