"""Events -> CTRs with a ServedModel. Pure; featurizes with the very code the stream uses and
scores with the trainer's own prediction (trainer.step.predict: the same lookup, the same forward)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.loader import ServedModel
from stream.featurize import featurize
from stream.records import Event
from stream.schema import Schema
from trainer.batch import batch_from_features
from trainer.step import predict


def predict_events(served: ServedModel, events: Sequence[Event], schema: Schema) -> np.ndarray:
    """CTR per event, float32 (n,)."""
    if not events:
        return np.zeros(0, dtype=np.float32)
    return predict(served.model, served.table, batch_from_features([featurize(events, schema)]))
