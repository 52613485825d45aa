"""The planning maths of speculation, shared by decode, the routers and the simulator.

The goodput model and the speculation lengths it grants (``goodput``), step-time models
(``step_time``), what drafting costs (``draft_cost``), acceptance calibration
(``calibration``) and the routing-stats contract a decode replica publishes
(``routing_stats``). Pure Python and numpy: nothing here imports torch or Ray, so the engine,
the Ray Serve routers and the simulator price a step the same way.
"""
