"""Infrastructure every stage shares: PERPETUA_HOME paths, table schemas, MLflow tracking, lineage keys, warning filters."""
