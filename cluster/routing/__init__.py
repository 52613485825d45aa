"""Request routing: decode placement by expected acceptance (and baselines), prefill placement
by prefix-cache affinity; pure policies, wired into Ray Serve by ``ray_routers``."""
