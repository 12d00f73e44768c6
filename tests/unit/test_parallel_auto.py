"""`training.parallel=auto`: the planner's layout for the run's ranks, resolved before the ranks start."""

import pytest
import torch

from reinforge.errors import ConfigError
from reinforge.model_config import ModelConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.parallel.layout import ParallelConfig, resolve_auto


def test_auto_is_the_planners_layout_of_the_ranks_and_says_so():
    training = TrainingConfig(backend="fsdp2", num_workers=2, parallel="auto")
    resolved, line = resolve_auto(training, ModelConfig(name_or_path="models/demo"), seq_len=256)
    parallel = resolved.parallel
    assert isinstance(parallel, ParallelConfig)
    assert parallel.dp_replicate * parallel.dp_shard * parallel.tp * parallel.cp == 2
    assert parallel.tp == 1 and parallel.cp == 1  # a 2M-parameter model fits whole: no split beyond FSDP2
    assert line.startswith("training.parallel=auto: dp_replicate=1 dp_shard=2 tp=1 cp=1 for 2 ranks")
    # a layout given is kept as it is; one process has nothing to split
    given = TrainingConfig(backend="fsdp2", num_workers=2, parallel=ParallelConfig(tp=2))
    assert resolve_auto(given, ModelConfig(name_or_path="models/demo"), 256) == (given, None)
    one, line = resolve_auto(TrainingConfig(parallel="auto"), ModelConfig(name_or_path="models/demo"), 256)
    assert one.parallel == ParallelConfig() and line is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the driver has a GPU here")
def test_auto_without_the_gpus_memory_is_a_one_line_error():
    training = TrainingConfig(backend="fsdp2", num_workers=2, parallel="auto")
    with pytest.raises(ConfigError, match="needs the GPUs' memory, and this driver has no GPU"):
        resolve_auto(training, ModelConfig(name_or_path="models/demo"), 256, num_gpus_per_worker=1)
