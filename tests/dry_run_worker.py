"""Dry-runs several (world size, rank, overrides) cases in one process and prints, per case, the
rank's measured parameter bytes and the planner's estimate for that rank, as one JSON line.

Usage: python tests/dry_run_worker.py CASES.json
"""

import json
import sys
from pathlib import Path

from meshtron.config import load_config
from meshtron.data.tokenizer import load_tokenizer
from meshtron.models.build import load_hf_config
from meshtron.plan.dry_run import dry_run
from meshtron.plan.layout import Layout, Workload
from meshtron.plan.memory import state_numel
from meshtron.plan.model_shape import ModelShape


def main() -> None:
    for case in json.loads(Path(sys.argv[1]).read_text()):
        cfg = load_config(None, case["overrides"], env={})
        report = dry_run(cfg, case["world"], case["rank"])
        hf_config = load_hf_config(cfg.model, load_tokenizer(cfg.data.tokenizer).vocab_size)
        layout = Layout.from_config(cfg, case["world"], hf_config)
        pp_rank = case["rank"] // (case["world"] // layout.pp)  # pp is the outermost mesh dim
        planned = state_numel(ModelShape.from_hf_config(hf_config, cfg.model), layout, Workload.from_config(cfg))[pp_rank]
        print(json.dumps({"name": case["name"], "params": report.params, "grads": report.grads,
                          "optimizer": report.optimizer, "planned_params": planned * 4, "seconds": report.seconds}),
              flush=True)


if __name__ == "__main__":
    main()
