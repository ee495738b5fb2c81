"""Stage `deploy` (asset deployment): the MLflow model registry, the champion alias and rollback."""
