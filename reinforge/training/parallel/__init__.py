"""The parallel layout of the training ranks, in one room: how `training.num_workers` ranks split the model and
its sequences, and which split to choose.

- layout.py: `training.parallel` (`ParallelConfig`), the device mesh its dimensions form (pp x dp_replicate
  x dp_shard x cp x tp), FSDP2's mesh over it, gradient clipping across meshes, and `parallel=auto`.
- tensor.py: tensor parallelism with sequence parallelism (`tp`): the layers' plan, the vocabulary-parallel LM
  head's logprobs.
- context.py: context parallelism (`cp`): each sequence's positions split over ranks, attention computed over
  the whole sequence by Ulysses' all-to-all of heads.
- expert.py: expert parallelism (`ep`): a mixture-of-experts model's experts split over ranks borrowed from
  FSDP2's shard ranks, tokens sent to their experts by all-to-all.
- pipeline.py: pipeline parallelism (`pp`, outermost in the mesh): the stage split by layer, applied before tensor
  parallelism and FSDP2 in training/fsdp2.py's `prepare`, and the passes through PyTorch's own schedules
  (`torch.distributed.pipelining`: 1F1B, GPipe); pipeline_weights.py: full weights and refit across the stages.
- lora_tensor.py: LoRA adapters split with their tensor-parallel base layers.
- planner.py, plan_layouts.py, plan_arithmetic.py and model_shape.py: the layout planner (memory and time of each
  layout from the model's shape), which `parallel=auto` and `reinforge plan` (plan_cli.py) use.
"""
