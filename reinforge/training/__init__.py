"""Training backends: logprobs, optimizer steps, weights for refit, export."""
