"""The share of comment and docstring lines in the product packages' Python files (blank lines
count in the total), and the files with the most of them.

    python tools/comment_ratio.py [package ...]
"""

import ast
import io
import sys
import tokenize
from pathlib import Path

PKGS = sys.argv[1:] or [
    "models",
    "runtime",
    "kvtransfer",
    "speculation",
    "prefill",
    "decode",
    "cluster",
    "distill",
    "serving",
]
tot = com = 0
per = {}
for pkg in PKGS:
    for p in Path(pkg).rglob("*.py"):
        if "proto" in p.parts:
            continue
        src = p.read_text()
        lines = src.splitlines()
        n = len(lines)
        doc = set()
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                b = node.body
                if (
                    b
                    and isinstance(b[0], ast.Expr)
                    and isinstance(b[0].value, ast.Constant)
                    and isinstance(b[0].value.value, str)
                ):
                    doc.update(range(b[0].lineno, b[0].end_lineno + 1))
        c = set()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                c.add(tok.start[0])
        k = len(doc | c)
        tot += n
        com += k
        per[str(p)] = (k, n)
print(f"{com}/{tot} = {100 * com / tot:.1f}%")
for f, (k, n) in sorted(per.items(), key=lambda x: -x[1][0])[:25]:
    print(f"  {f}: {k}/{n} {100 * k / n:.0f}%")
