from __future__ import annotations

import os
import resource


def process_memory() -> dict[str, int]:
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * page
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"rss_bytes": rss, "peak_rss_bytes": peak}
