"""Copy-heavy prompts (repeat, edit, extract): where prompt lookup speculation pays."""

from __future__ import annotations

PASSAGE = (
    "The Roman Empire was the post-Republican state of ancient Rome. It included territory "
    "around the Mediterranean in Europe, North Africa, and Western Asia, and was ruled by "
    "emperors. The fall of the Western Roman Empire in 476 AD conventionally marks the end of "
    "classical antiquity and the beginning of the Middle Ages."
)
CODE = (
    "def moving_average(values, window):\n"
    "    result = []\n"
    "    for i in range(len(values) - window + 1):\n"
    "        chunk = values[i:i + window]\n"
    "        result.append(sum(chunk) / window)\n"
    "    return result\n"
)

COPY_PROMPTS: tuple[str, ...] = (
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this function, renaming `values` to `data` and changing nothing else:\n\n{CODE}",
    f"Copy this paragraph, then copy it again:\n\n{PASSAGE}",
    f"Return this code unchanged inside a markdown code block:\n\n{CODE}",
    "Repeat this list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "honeydew, kiwis, lemons, mangoes, nectarines, oranges, papayas.",
    f"Extract the first two sentences of this text verbatim:\n\n{PASSAGE}",
)
