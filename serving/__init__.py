"""What every replica shares: the pool health board, replica logs, serving metrics, the
autoscaling metric names, shared acceptance priors. Imports no deployment (cluster/, prefill/,
decode/): they import it."""
