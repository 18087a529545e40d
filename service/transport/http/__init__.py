"""The HTTP side: the operator API, the REST data plane, health, metrics and the pool map."""
