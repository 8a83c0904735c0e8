"""A group's completions depend on the weights, the prompt and the key alone: not on the process, what it sampled
before, or how the weights are sharded (contract/group_sampling.py).

Run as a script under torchrun, this file is the worker of the two-process FSDP2 check.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch

from accel_trainer.contract.group_sampling import sample_group, seed_of
from accel_trainer.processes import free_port

transformers = pytest.importorskip("transformers")

EOS = list(range(1, 17))  # 16 of 128 tokens: a random model's completions end after about 8 tokens
PAD = 0
SETTINGS = dict(num_generations=4, max_completion_length=16, temperature=1.0, top_p=1.0, eos_token_ids=EOS,
                pad_token_id=PAD)  # fmt: skip
PROMPTS = [torch.tensor([5, 6, 7]), torch.tensor([9, 10, 11, 12, 13])]


def tiny_llama(**config) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, **config)  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama()


def sample(model, index: int = 0, step: int = 3, seed: int = 0, **settings):
    return sample_group(model, PROMPTS[index], **{**SETTINGS, **settings}, key=(seed, step, index))


def test_the_same_key_samples_the_same_group_bit_for_bit_and_another_seed_step_or_prompt_index_another(model):
    group = sample(model)
    assert torch.equal(group.completion_ids, sample(model).completion_ids)
    others = [sample(model, seed=1), sample(model, step=4), sample(model, index=1, step=3)]
    assert all(not torch.equal(group.completion_ids, other.completion_ids) for other in others)
    assert len({seed_of((1, 23)), seed_of((12, 3)), seed_of((1, 2, 3)), seed_of((3, 2, 1))}) == 4
    assert 0 <= seed_of((2**70, -5)) < 2**63


def test_a_group_does_not_depend_on_what_the_process_sampled_before_and_leaves_its_random_state_as_it_was(model):
    torch.manual_seed(1)
    first = sample(model)
    torch.manual_seed(2)
    torch.rand(100)
    sample(model, index=1)
    before = torch.get_rng_state()
    again = sample(model)
    assert torch.equal(first.completion_ids, again.completion_ids)
    assert torch.equal(torch.get_rng_state(), before)


def test_the_mask_covers_each_completion_up_to_and_including_its_first_eos_and_pad_follows(model):
    group = sample(model)  # this key's group: three completions end with an EOS, one runs to 16 tokens
    lengths = group.completion_mask.sum(dim=1)
    assert group.finished.tolist() == [True, True, False, True] and lengths.tolist() == [2, 11, 16, 4]
    assert group.completion_ids.shape == group.completion_mask.shape == (4, 16)
    rows = zip(group.completion_ids, group.completion_mask, lengths, group.finished, strict=True)
    for ids, mask, length, finished in rows:
        assert mask[:length].all() and not mask[length:].any()
        assert (ids[length:] == PAD).all()
        is_eos = torch.isin(ids[:length], torch.tensor(EOS))
        assert is_eos.tolist() == [False] * (length - 1) + [bool(finished)]


def test_a_group_whose_completions_all_end_early_is_as_long_as_its_longest(model):
    group = sample(model, step=2)
    assert group.finished.all() and group.completion_mask.sum(dim=1).tolist() == [8, 8, 11, 2]
    assert group.completion_ids.shape == (4, 11)


@pytest.mark.parametrize("settings", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-5)])
def test_temperature_top_p_and_top_k_reach_generate_so_a_one_token_choice_is_greedy_decoding(model, settings):
    group = sample(model, **settings)
    greedy = model.generate(PROMPTS[0][None], do_sample=False, max_new_tokens=16, eos_token_id=EOS, pad_token_id=PAD)
    continuation = greedy[0, PROMPTS[0].numel() :]
    assert all(torch.equal(row[: continuation.numel()], continuation) for row in group.completion_ids)


def test_top_k_0_is_off_not_transformers_default_of_50(model):
    assert not torch.equal(sample(model, top_k=0).completion_ids, sample(model, top_k=50).completion_ids)


def test_a_model_in_training_mode_samples_without_dropout_and_gets_each_modules_mode_back():
    dropped = tiny_llama(attention_dropout=0.5).train()
    dropped.model.layers[0].eval()  # a part the caller keeps in eval mode (a frozen part, say)
    group = sample(dropped)
    assert dropped.training and not dropped.model.layers[0].training and dropped.model.layers[1].training
    assert torch.equal(group.completion_ids, sample(dropped.eval()).completion_ids)


# each rank's groups, in order: rank 0's first group ends at 11 tokens, rank 1's at 16; their second the reverse
RANK_GROUPS = [[(0, 2), (0, 4)], [(1, 2), (1, 4)]]  # (prompt index, step)


@pytest.mark.multiprocess
def test_two_fsdp2_processes_each_sample_their_groups_as_one_process_does_though_the_groups_end_apart():
    """FSDP2's forwards all-gather the weights, so both processes must run the same number of them although
    each one's group ends at another length: `synced=True` (transformers' synced_gpus) keeps the one that is done
    running forwards. Without it the two run different numbers of all-gathers (27 and 25 here), which pair up
    across unrelated forwards until one process is done: this launch then fails, a longer run hangs."""
    from conftest import clean_env  # not at the top: the worker runs this file where tests/ is not on its path

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    result = subprocess.run([*launcher, __file__], capture_output=True, text=True, timeout=180, env=clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line[len("GROUPS ") :] for line in result.stdout.splitlines() if line.startswith("GROUPS ")]
    reports = sorted((json.loads(line) for line in lines), key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == [0, 1]
    for report in reports:
        assert report["sharded"] == report["alone"], report
    lengths = [[len(ids[0]) for ids in report["sharded"]] for report in reports]
    assert lengths == [[11, 16], [16, 9]]  # the groups end at different lengths on the two processes


def fsdp_worker() -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    alone = tiny_llama()
    sharded = copy.deepcopy(alone)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    report: dict = {"rank": rank, "sharded": [], "alone": []}
    for index, step in RANK_GROUPS[rank]:
        report["sharded"].append(sample(sharded, index=index, step=step, synced=True).completion_ids.tolist())
        report["alone"].append(sample(alone, index=index, step=step).completion_ids.tolist())
    # One write of the whole line: unbuffered (clean_env's PYTHONUNBUFFERED), print writes the text and its newline
    # apart, and the other rank's line could land between them ("Extra data" in one CI run of 5).
    os.write(sys.stdout.fileno(), ("GROUPS " + json.dumps(report) + "\n").encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    fsdp_worker()
