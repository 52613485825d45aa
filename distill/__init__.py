"""``tandem distill``: making a draft for a target.

The data (ShareGPT conversations, the target's own greedy continuations and features), the
training objective and loop of an EAGLE-style head, its evaluation on a held-out split, and the
card shipped beside it. Offline tooling: serving code never imports this package.
"""
