"""Stage `evaluate` (asset eval_report): eval sets, scoring statistics and the deploy gate."""
