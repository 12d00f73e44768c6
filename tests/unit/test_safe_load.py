"""Checkpoints and converted files from elsewhere load without running code (training/safe_load.py): a pickle
that names a function to call is a one-line error naming the file, and reinforge's own checkpoints still load."""

import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from reinforge.data.batch import Trajectory
from reinforge.errors import DataError
from reinforge.rollout.in_flight import InFlightPending
from reinforge.training.checkpoint import load_driver_state, rng_state
from reinforge.training.safe_load import dcp_load
from reinforge.training.state import model_state_dict


class Planted:
    """What a hostile checkpoint holds: unpickling it calls os.system (here: it would create a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_driver_state_of_reinforge_s_own_classes_loads_and_one_that_runs_code_is_refused(tmp_path):
    routes = np.arange(6, dtype=np.uint8).reshape(3, 2, 1)  # an MoE trajectory's, as the engine returns them
    trajectory = Trajectory([1, 2], [3], [-0.5], False, 1.0, 0, "math", routed_experts=routes)
    pending = [InFlightPending(ready=[(0, None, [trajectory])], redo=[(1, None)])]
    state = {"step": 3, "rng": rng_state(), "pending_rollouts": pending, "best": {}}
    torch.save(state, tmp_path / "driver.pt")
    loaded = load_driver_state(tmp_path)
    assert loaded["step"] == 3 and loaded["pending_rollouts"][0].redo == [(1, None)]
    assert np.array_equal(loaded["pending_rollouts"][0].ready[0][2][0].routed_experts, routes)
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])

    marker = tmp_path / "ran"
    torch.save({"step": 3, "payload": Planted(marker)}, tmp_path / "driver.pt")
    with pytest.raises(DataError, match=r"driver.pt needs posix.system to load") as refused:
        load_driver_state(tmp_path)
    assert "\n" not in str(refused.value) and not marker.exists()


def test_a_dcp_checkpoint_loads_and_one_whose_metadata_or_entries_run_code_is_refused(tmp_path):
    weights = {"weight": torch.arange(6.0).reshape(2, 3)}
    dcp.save({"model": weights, "optimizer": {"step": 7}}, checkpoint_id=str(tmp_path), no_dist=True)
    assert torch.equal(model_state_dict(tmp_path)["weight"], weights["weight"])

    marker = tmp_path / "ran"
    metadata = tmp_path / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(Planted(marker)))
    with pytest.raises(DataError, match=r"\.metadata needs posix.system to load"):
        model_state_dict(tmp_path)
    assert not marker.exists()
    metadata.write_bytes(original)

    hostile = tmp_path / "hostile"
    dcp.save({"optimizer": {"step": Planted(marker)}}, checkpoint_id=str(hostile), no_dist=True)
    marker.unlink(missing_ok=True)  # saving it pickled it, which did not run it; make sure
    state = {"optimizer": {"step": 0}}
    with pytest.raises(DataError, match="hostile's entry optimizer.step needs posix.system to load"):
        dcp_load(state, hostile, distributed=False)
    assert not marker.exists()
