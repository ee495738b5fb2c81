"""Stage logic as plain Python: no Dagster imports here, so every piece is unit-testable alone."""
