"""adstream: the one CLI and the local stack (Kafka, MLflow). Thin wiring only."""
