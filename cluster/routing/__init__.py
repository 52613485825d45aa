"""Request routing: decode placement by expected acceptance (and baselines), prefill placement
by prefix-cache affinity. Pure policies over a replica table, wired into Ray Serve by
``cluster.routing.ray_routers``."""
