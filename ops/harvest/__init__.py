"""Stage `harvest` (assets production_traces, harvested_failures): the trace contract, the incremental
quarantining harvester and the production-traffic simulator.

`harvester.harvest` is the entry point and reads top to bottom; each phase lives in one module:
`landing` (what is in the landing zone), `jsonl_source` / `parquet_source` / `mlflow_source`
(reading new records), `validation` (the vectorised contract check), `classify` (counts,
quarantine, dedup), `failures` (the harvested failures table), `state` (cursor, lock,
generations) and `known_versions` (which model versions are real)."""
