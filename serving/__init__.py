"""What every replica shares; it imports no deployment (cluster/, prefill/, decode/ import it)."""
