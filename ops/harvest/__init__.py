"""Stage `harvest` (assets production_traces, harvested_failures): the trace contract, the incremental
quarantining harvester and the production-traffic simulator."""
