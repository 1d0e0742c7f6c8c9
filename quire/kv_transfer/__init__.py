"""Prefill/decode disaggregation's KV connector: the scheduler side (scheduler_connector.py),
the worker side (worker_connector.py) and the TCP transport between instances (transport.py)."""
