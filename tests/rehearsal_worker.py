"""Rehearse ranks of layouts (meshtron.plan.rehearsal), each in a process forked from this one; write what each
measured.

Usage: python tests/rehearsal_worker.py CASES.json OUT.json, CASES a list of {name, world, rank, steps, overrides}.
A fork per rehearsal, as ``meshtron train --rehearse`` runs one per process: torch keeps caches keyed by device
mesh (DTensor's sharding propagation) that would hand one rehearsal's destroyed process groups to the next
rehearsal of an equal mesh. The fork inherits the imports, which are most of a rehearsal's cost here.
"""

import json
import multiprocessing
import sys
from pathlib import Path

from parity_worker import import_before_forking

import meshtron.train.trainer  # noqa: F401  (imported once, before the forks)
from meshtron.config import load_config
from meshtron.plan.rehearsal import rehearse


def run_case(case: dict) -> dict:
    cfg = load_config(None, case["overrides"], env={})
    return rehearse(cfg, case["world"], case["rank"], steps=case["steps"]).to_json()


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    import_before_forking()
    with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
        reports = pool.map(run_case, cases, chunksize=1)
    results = {f"{case['name']}:{case['rank']}": report for case, report in zip(cases, reports)}
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
