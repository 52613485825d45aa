"""The decode autoscaling simulator's parts (entry point: ``bench/autoscale_sim.py``)."""
