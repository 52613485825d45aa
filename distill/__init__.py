"""``tandem distill``: offline tooling that trains an EAGLE-style draft head for a target."""
