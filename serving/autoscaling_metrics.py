"""The custom autoscaling metrics a decode replica reports (``DecodeServer``'s
``record_autoscaling_stats``) and the pool's policy reads (``cluster.capacity_policy``): one
name each, so the two sides cannot drift apart. Constants only: Serve's controller imports
them with the policy."""

STREAMS = "streams"  # running plus queued requests on the replica
CAPACITY = "capacity_streams"  # streams of the current mix it can hold within the SLO
CAPACITY_TOK_S = "capacity_tok_s"  # goodput it can deliver within the SLO (>= one stream's)
HEADROOM_TOK_S = "headroom_tok_s"  # goodput it could add within the SLO
GOODPUT_TOK_S = "goodput_tok_s"  # tokens per second it delivered
