"""Supervision of the long-lived local services (the vLLM servers, the MLflow server): start, reuse, stop."""
