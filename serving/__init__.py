"""serving: the newest snapshot behind an MLflow alias, served over HTTP."""
