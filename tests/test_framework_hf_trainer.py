"""The HF Trainer and TRL's SFTTrainer on flatshard through the opt-in: with FSDP1 (``fsdp_config={"version": 1}``,
issue 19) and with their default FSDP2 (accelerate's ``fully_shard`` path, issue 32).

A tiny Llama built from a config, 4 optimizer steps of the Trainer's own loop (FSDP2's of 2 micro-batches each,
the Trainer's gradient accumulation; its FSDP1 path:
accelerate's ``prepare``, its ``FSDP.clip_grad_norm_``, its checkpointing), a checkpoint
saved at step 2 (FULL_STATE_DICT, model and optimizer through accelerate), then a second
Trainer resuming from it (``resume_from_checkpoint``). Oracles: torch's FSDP1 running the
same Trainer without checkpoints (torch's FSDP2 for version 2; the per-step losses must match within rtol 1e-5, the
clipping norm's summation order; see tests/test_hf_sft.py), and the resumed run's last
losses must be those of the run that went on (bit for bit). TRL's ``SFTTrainer`` (a Trainer
subclass with its own dataset pipeline, collator and loss) runs the same way.

Forcing the FSDP path on a CPU: a Trainer subclass does, once the Trainer made its Accelerator, what
[Note: Forcing a framework's FSDP path on a CPU] in tests/_frameworks.py says.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from flatshard.testing import run_distributed
from _frameworks import force_accelerate_fsdp, reset_accelerate, set_launcher_environment, tiny_llama

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

RTOL = 1e-5


def _force_fsdp(trainer, full_loads: bool):
    """After the Trainer made its Accelerator: see [Note: Forcing a framework's FSDP path on a CPU] (the plugin
    built from the Trainer's own fsdp_plugin_args)."""
    from accelerate import FullyShardedDataParallelPlugin

    force_accelerate_fsdp(trainer.accelerator.state, FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args),
                          full_loads)
    trainer.is_fsdp_enabled = True


def _cpu_fsdp(trainer_class, full_loads: bool = False):
    class CPUFSDPTrainer(trainer_class):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            _force_fsdp(self, full_loads)

    return CPUFSDPTrainer


def _args(config_class, out, save: bool, version: int, **extra):
    """FSDP1 as before; FSDP2 as the Trainer's default (``fsdp_config`` without a ``version``)."""
    fsdp_config = {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": "FULL_STATE_DICT"}
    if version == 1:
        fsdp_config.update(version=1, use_orig_params=True,
                           sync_module_states=False)  # (accelerate refuses it without an accelerator)
    return config_class(
        output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="steps" if save else "no", save_steps=2, report_to=[], use_cpu=True,
        fsdp="full_shard auto_wrap", seed=0, data_seed=0, dataloader_num_workers=0, max_grad_norm=1.0,
        fsdp_config=fsdp_config, **extra)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (16, 12), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _losses(trainer):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _runs(rank, world_size, tmp, trainer_class, args_class, make_data, version, **args_extra):
    """torch's FSDP (``version``) without checkpoints, then flatshard (the opt-in) saving at step 2, then flatshard
    resuming from that checkpoint: each run's logged losses, and whether the trained model was flatshard's."""
    import flatshard

    set_launcher_environment(rank, world_size)

    def train(impl, save, resume=None):
        reset_accelerate()
        trainer = _cpu_fsdp(trainer_class, full_loads=impl == "flatshard" and version == 1)(
            model=tiny_llama(), args=_args(args_class, os.path.join(tmp, impl), save, version, **args_extra),
            **make_data())
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = train("torch", save=False)
        got["torch"] = _losses(trainer)
        got["torch_was_flatshard"] = _is_flatshard(trainer.model_wrapped)
        flatshard.install_as_torch_fsdp()
        try:
            trainer = train("flatshard", save=True)
            got["flatshard"] = _losses(trainer)
            got["is_flatshard"] = _is_flatshard(trainer.model_wrapped)
            got["resumed"] = _losses(train("flatshard", save=False,
                                           resume=os.path.join(tmp, "flatshard", "checkpoint-2")))
        finally:
            flatshard.uninstall_as_torch_fsdp()
    return got


def _is_flatshard(model) -> bool:
    """Whether the model the Trainer trained is flatshard's: the class's units (FSDP1) or fully_shard's (FSDP2)."""
    return getattr(model, "_is_flatshard_unit", False)


def _check(got):
    assert got["is_flatshard"], "the trainer's model is not flatshard's"
    assert not got["torch_was_flatshard"], "with the opt-in off the trainer's model is not torch's"
    assert len(got["flatshard"]) == len(got["torch"]) == 4
    torch.testing.assert_close(torch.tensor(got["flatshard"]), torch.tensor(got["torch"]), rtol=RTOL, atol=0,
                               msg=f"losses {got['flatshard']} vs torch {got['torch']}")
    # (log_history comes back with the checkpoint: the first two entries are the saved run's)
    assert got["resumed"] == got["flatshard"], f"resumed {got['resumed']} vs {got['flatshard']}"


def _trainer_runs(rank, world_size, tmp, version):
    from transformers import Trainer, TrainingArguments

    # (FSDP2: two micro-batches per optimizer step, the Trainer's gradient accumulation: its no_sync is FSDP2's
    # set_requires_gradient_sync)
    return _runs(rank, world_size, tmp, Trainer, TrainingArguments, lambda: {"train_dataset": _Tokens()}, version,
                 gradient_accumulation_steps=2 if version == 2 else 1)


def test_hf_trainer_fsdp1_trains_saves_and_resumes_as_torch(tmp_path):
    _check(run_distributed(_trainer_runs, 2, str(tmp_path), 1, timeout=280)[0])


def test_hf_trainer_default_fsdp2_trains_saves_and_resumes_as_torch(tmp_path):
    """The Trainer's default FSDP (version 2: accelerate's fully_shard path) reaches flatshard's fully_shard."""
    _check(run_distributed(_trainer_runs, 2, str(tmp_path), 2, timeout=280)[0])


def _tokenizer():
    """A word-level tokenizer over the tiny Llama's 128 ids, built in code (nothing downloaded)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t1")), pad_token="t0",
                                   eos_token="t2", unk_token="t1")


def _sft_runs(rank, world_size, tmp, version):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    ids = torch.randint(1, 128, (16, 12), generator=torch.Generator().manual_seed(5)).tolist()
    return _runs(rank, world_size, tmp, SFTTrainer, SFTConfig,
                 lambda: {"train_dataset": Dataset.from_dict({"input_ids": ids}), "processing_class": _tokenizer()},
                 version, packing=False, max_length=12)


@pytest.mark.parametrize("version", [1, 2])
def test_trl_sft_trainer_trains_saves_and_resumes_as_torch(version, tmp_path):
    pytest.importorskip("trl")
    _check(run_distributed(_sft_runs, 2, str(tmp_path), version, timeout=280)[0])
