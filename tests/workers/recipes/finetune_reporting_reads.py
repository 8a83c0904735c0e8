"""`finetune_reporting_reads`: hf_finetune, noting in the run folder whether each process's build read the base's
weights (`read_base_rank<r>`: True or False), for the test that FSDP's RAM-efficient loading reads it once."""

import os
from pathlib import Path

import accel_trainer as at


@at.register_recipe("finetune_reporting_reads")
class FinetuneReportingReads(at.get_recipe("hf_finetune")):  # type: ignore[misc]
    def build_model(self, cfg):
        model = super().build_model(cfg)
        note = Path(cfg.output_dir) / f"read_base_rank{os.environ.get('RANK', '0')}"
        if not note.exists():  # the training build (FLOP counting builds on the meta device later)
            note.write_text(str(not any(p.is_meta for p in model.parameters())))
        return model
