"""Autotuned kernel configs, persisted per GPU."""
