"""Sidecar."""
