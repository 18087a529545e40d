"""What operators watch: the Prometheus metrics (``metrics.py``) and MPS (``mps.py``)."""
