"""A sharded background save's host copies: exact, in buffers reused from one save to the next, and remade only
for a tensor whose layout changed."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from accel_trainer.checkpoint.host_shards import HostShards
from conftest import one_process_mesh


@pytest.fixture
def mesh():
    with one_process_mesh("dp") as mesh:
        yield mesh


def test_the_copies_are_exact_and_later_saves_reuse_their_buffers(mesh):
    weight = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    state = {"model/w": weight, "optimizer/step": torch.tensor(3.0), "model/b": torch.randn(4)}
    shards = HostShards()

    first = shards.copy(state)
    assert isinstance(first["model/w"], DTensor)
    assert (first["model/w"].placements, first["model/w"].shape) == (weight.placements, weight.shape)
    assert all(torch.equal(_local(first[k]), _local(v)) for k, v in state.items())
    assert _local(first["model/w"]).data_ptr() != weight.to_local().data_ptr()  # a copy, not a view

    with torch.no_grad():
        weight.to_local().add_(1.0)  # the next optimizer step changes the weights after the copy
    assert not torch.equal(_local(first["model/w"]), weight.to_local())
    second = shards.copy(state)
    assert torch.equal(_local(second["model/w"]), weight.to_local())
    assert all(_local(second[k]).data_ptr() == _local(first[k]).data_ptr() for k in state)


def test_tied_tensors_become_separate_contiguous_copies():
    tied = torch.randn(3, 5)
    staged = HostShards().copy({"embed": tied, "head": tied, "transposed": tied.t()})
    assert len({t.data_ptr() for t in staged.values()}) == 3
    assert all(t.is_contiguous() for t in staged.values())
    assert torch.equal(staged["transposed"], tied.t())


def test_a_tensor_whose_layout_changed_gets_a_new_copy_and_a_gone_one_is_dropped(mesh):
    shards = HostShards()
    first = shards.copy({"w": distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]), "gone": torch.zeros(2)})
    replicated = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    second = shards.copy({"w": replicated})
    assert list(second) == ["w"]
    assert second["w"].placements == (Replicate(),)
    assert torch.equal(_local(second["w"]), replicated.to_local())
    assert _local(second["w"]).data_ptr() != _local(first["w"]).data_ptr()


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def test_canary_dcp_logs_every_element_of_the_state_dict_on_the_calling_thread(monkeypatch):
    """Why a sharded background save on the CPU copies into HostShards and runs `dcp.save` on the writer's
    thread: `dcp.async_save`'s `_stateful_to_state_dict`, on the caller's thread, builds a logger record for each
    element (a start and an end). The day it stops, async_save may be cheap enough to call from the training
    thread (docs/accelerate-traps.md)."""
    from torch.distributed.checkpoint import logger as dcp_logger
    from torch.distributed.checkpoint.state_dict_saver import _stateful_to_state_dict

    records = []
    monkeypatch.setattr(dcp_logger._dcp_logger, "debug", records.append)
    _stateful_to_state_dict({f"t{i}": torch.zeros(1) for i in range(100)})
    assert len(records) >= 200
