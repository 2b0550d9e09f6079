"""peft LoRA + the Hugging Face Trainer on one process: the run bench/lora.py compares meshtron's LoRA with.

The same model (a meshtron preset's config, fp32, byte vocabulary), LoRA rank and alpha on the same projections
(every attention and MLP projection), sequence length, batch and AdamW as ``meshtron train`` in bench/lora.py;
the tokens are random (step time does not depend on them). Prints one JSON line: the median seconds per optimizer
step after the warm-up steps (timed by a TrainerCallback from step begin to step end) and the process's peak
resident memory in GB (what meshtron's ``max_memory_gb`` reports on CPU). Run by bench/lora.py as:

    OMP_NUM_THREADS=1 python bench/peft_trainer.py --preset llama-small --seq-len 256 --batch 8 --steps 10 --rank 16
"""

from __future__ import annotations

import json
import resource
import statistics
import tempfile
import time

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BYTE_VOCAB = 257


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count: int, seq_len: int):
        self.ids = torch.randint(0, BYTE_VOCAB, (count, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    from optimizer import bench_parser  # the settings bench/lora.py passes on (its rounds and layouts unused here)
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from meshtron.models.presets import make_preset_config

    parser = bench_parser(__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_preset_config(args.preset, BYTE_VOCAB)).float()
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS))

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []

        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.start)

    times = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=args.batch,
            max_steps=args.steps,
            learning_rate=3e-4,
            weight_decay=0.1,
            optim="adamw_torch",
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        dataset = RandomTokens(args.batch * args.steps, args.seq_len)
        Trainer(model=model, args=training, train_dataset=dataset, callbacks=[times]).train()
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(json.dumps({"seconds": statistics.median(times.seconds[args.warmup :]), "max_memory_gb": peak_gb}))


if __name__ == "__main__":
    main()
