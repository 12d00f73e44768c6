"""`distill.teachers[].placement=ray`: a teacher in a Ray actor of its own (cluster/teacher_group.py) gives the
same scores (sampled-token logprobs, top-k ids and logprobs) as the teacher in the driver's process."""

import torch
from test_distill import TEMPERATURE, K, ragged

from reinforge.cluster import worker_group
from reinforge.cluster.config import ClusterConfig
from reinforge.cluster.teacher_group import TeacherGroup
from reinforge.model_config import ModelConfig
from reinforge.training.base import TrainingConfig
from reinforge.training.teacher import Teacher


def test_a_teacher_in_a_ray_actor_scores_as_the_teacher_in_process(tiny_model_dir):
    model, training, cluster = (
        ModelConfig(name_or_path=str(tiny_model_dir)),
        TrainingConfig(micro_batch_size=3),
        ClusterConfig(),
    )
    batch = ragged()
    stop_ray = worker_group.ensure_ray(cluster, 1)
    try:
        group = TeacherGroup(model, training, TEMPERATURE, cluster)
        remote = group.score(batch, K)
        group.shutdown()
    finally:
        stop_ray()
    assert remote[0].abs().sum() > 0
    for got, want in zip(remote, Teacher(model, training, TEMPERATURE).score(batch, K)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
