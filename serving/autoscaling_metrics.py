"""The custom autoscaling metrics a decode replica reports and the pool's policy reads."""

STREAMS = "streams"  # running plus queued requests on the replica
CAPACITY = "capacity_streams"  # streams of the current mix it can hold within the SLO
CAPACITY_TOK_S = "capacity_tok_s"  # goodput it can deliver within the SLO (>= one stream's)
HEADROOM_TOK_S = "headroom_tok_s"
GOODPUT_TOK_S = "goodput_tok_s"
