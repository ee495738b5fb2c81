"""Benchmarks behind `perpetua bench NAME`: each stage's path against a baseline run side by side."""
