"""Dagster assembly: Definitions, jobs, schedules, sensors and resources."""
