"""The baseline of `adstream bench serving`: the same publication behind MLflow's own scoring server
(`mlflow models serve`), as a pyfunc "model from code" (no pickled class). It predicts with the very
functions adstream's server uses, so the two differ only in the serving layer."""

from __future__ import annotations

import math
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class PublicationModel(PythonModel):
    def load_context(self, context: Any) -> None:
        from serving.loader import load_served_model
        from stream.schema import load_schema

        self.schema = load_schema(context.artifacts["schema"])
        self.served = load_served_model(context.artifacts["publication"], "pyfunc", self.schema)

    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        """model_input: a DataFrame of events (the Kafka JSON fields) -> one CTR per row. (No type
        hints: MLflow would try to build a signature from them.)"""
        from serving.predict import predict_events
        from stream.featurizer.decode import event_from_mapping

        rows = [self._native(row) for row in model_input.to_dict("records")]
        events = [event_from_mapping(row, self.schema, require_label=False) for row in rows]
        return [float(c) for c in predict_events(self.served, events, self.schema)]

    def _native(self, row: dict[str, Any]) -> dict[str, Any]:
        """Undo what a DataFrame did to JSON values: a missing integer became NaN and its column
        float; both back to what the event had (None, int)."""
        out = {}
        for name, value in row.items():
            if isinstance(value, float) and math.isnan(value):
                value = None
            elif isinstance(value, float) and name in self.schema.integer_fields and value.is_integer():
                value = int(value)
            out[name] = value
        return out


mlflow.models.set_model(PublicationModel())
