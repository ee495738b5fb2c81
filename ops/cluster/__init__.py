"""Deployment on Kubernetes: typed cluster configuration (`config`), rendering of the Dagster
chart values, the code-location Dockerfile and the manifests (`render`), and their offline
validation against the `kubernetes` client's models (`validate`). `perpetua cluster render`."""
