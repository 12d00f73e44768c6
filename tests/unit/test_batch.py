import torch

from reinforge.data.batch import Trajectory, collate


def test_loss_mask_covers_response_tokens_only_never_prompt_or_padding():
    short = Trajectory(
        prompt_ids=[5, 6],
        response_ids=[7, 8],
        gen_logprobs=[-0.1, -0.2],
        truncated=False,
        reward=1.0,
        group=0,
        task="math",
    )
    long = Trajectory(
        prompt_ids=[5, 6, 9],
        response_ids=[7, 8],
        gen_logprobs=[-0.3, -0.4],
        truncated=True,
        reward=0.0,
        group=0,
        task="math",
    )
    batch = collate([short, long], advantages=[0.5, -0.5], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 0], [5, 6, 9, 7, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    torch.testing.assert_close(batch.gen_logprobs, torch.tensor([[0, 0, -0.1, -0.2, 0], [0, 0, 0, -0.3, -0.4]]))
    assert batch.advantages.tolist() == [[0, 0, 0.5, 0.5, 0], [0, 0, 0, -0.5, -0.5]]  # each token's, 0 off the mask


def test_a_sequences_advantage_is_spread_over_its_trained_tokens_only():
    """An environment observation inside the response (response_mask 0) and a masked trajectory get no advantage."""
    multi_turn = Trajectory([5], [7, 3, 8], [-0.1, 0.0, -0.2], False, 1.0, 0, "math", response_mask=[1, 0, 1])
    masked = Trajectory([5], [7, 8], [-0.1, -0.2], True, 0.0, 0, "math", masked=True)
    batch = collate([multi_turn, masked], advantages=[2.0, -1.0], pad_token_id=0)
    assert batch.loss_mask.tolist() == [[0, 1, 0, 1], [0, 0, 0, 0]]
    assert batch.advantages.tolist() == [[0, 2.0, 0, 2.0], [0, 0, 0, 0]]


def test_slice_drops_columns_that_are_padding_in_every_row():
    a = Trajectory([1], [2], [0.0], False, 0.0, 0, "math")
    b = Trajectory([1, 1, 1], [2, 2], [0.0, 0.0], False, 0.0, 0, "math")
    batch = collate([a, b], [1.0, 1.0], pad_token_id=0)
    assert batch.input_ids.shape == (2, 5)
    assert batch.slice(0, 1).input_ids.tolist() == [[1, 2]]
    assert batch.slice(1, 2).loss_mask.tolist() == [[0, 0, 0, 1, 1]]
    assert batch.slice(0, 1).advantages.tolist() == [[0, 1.0]]
