"""Events -> CTRs with a ServedModel. Pure; featurizes with the very code the stream uses."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from serving.loader import ServedModel
from stream.featurize import featurize
from stream.records import Event
from stream.schema import Schema


@torch.no_grad()
def predict_events(served: ServedModel, events: Sequence[Event], schema: Schema) -> np.ndarray:
    """CTR per event, float32 (n,)."""
    if not events:
        return np.zeros(0, dtype=np.float32)
    features = featurize(events, schema)
    n, f = features.ids.shape
    rows = served.rows(features.ids).view(n, f, -1)
    logits = served.model(rows, torch.from_numpy(features.dense))
    return torch.sigmoid(logits).numpy()
