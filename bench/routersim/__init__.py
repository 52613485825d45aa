"""The router simulator's parts (entry point: ``bench/router_sim.py``)."""
