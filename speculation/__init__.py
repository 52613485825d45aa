"""Speculation planning maths shared by the engine, the routers and the simulator (no torch)."""
