"""trainer: batches -> train steps -> snapshots published to MLflow."""
