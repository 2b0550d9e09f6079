"""Dry-runs several (world size, rank, overrides) cases in one process and prints, per case, the
rank's measured parameter bytes and the planner's estimate for that rank, as one JSON line.

Usage: python tests/dry_run_worker.py CASES.json
"""

import json
import sys
from pathlib import Path

from meshtron.config import load_config
from meshtron.plan.dry_run import dry_run
from meshtron.plan.memory import config_view, param_bytes_of_rank, pinned_state_rounding


def main() -> None:
    for case in json.loads(Path(sys.argv[1]).read_text()):
        cfg = load_config(None, case["overrides"], env={})
        report = dry_run(cfg, case["world"], case["rank"])
        view = config_view(cfg, case["world"])
        planned = param_bytes_of_rank(*view, case["rank"])
        pinned = {}
        if report.pinned_state is not None:  # the rounding FSDP2's pinned shards add (pp = 1: one pipeline rank)
            pinned = {"pinning": report.pinned_state - report.params - report.grads}
            pinned["planned_pinning"] = pinned_state_rounding(*view)[0]
        print(
            json.dumps(
                {
                    "name": case["name"],
                    "params": report.params,
                    "grads": report.grads,
                    "optimizer": report.optimizer,
                    "planned_params": planned,
                    "seconds": report.seconds,
                    **pinned,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
