"""Search seconds against training seconds of ``memplan.fit("examples/digits.py", vram="1GB")``.

    python benchmarks/search_effort.py OUT_DIR                      # the default effort (0.1)
    python benchmarks/search_effort.py OUT_DIR '{"search_effort": 1000}'   # no budget in effect

Runs in an empty cache folder of its own (every trace and probe counted); prints one JSON line:
the search's seconds (until the plan is known), the training's, the plan's notes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

os.environ["MEMPLAN_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import memplan  # noqa: E402


def main() -> None:
    out = sys.argv[1]
    kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    marks: dict[str, float] = {}
    t0 = time.perf_counter()
    plan, _ = memplan.fit("examples/digits.py", vram="1GB", out_dir=out, overwrite=True,
                          on_plan=lambda p: marks.setdefault("plan", time.perf_counter()), **kwargs)
    t1 = time.perf_counter()
    print(json.dumps({"search_s": marks["plan"] - t0, "train_s": t1 - marks["plan"], "load": os.getloadavg()[0],
                      "config": plan.best.config.describe(), "notes": plan.notes}))


if __name__ == "__main__":
    main()
