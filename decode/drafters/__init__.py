"""Drafters: what proposes the tokens the target verifies."""
