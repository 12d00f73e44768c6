"""Generation backends: sample completions with per-token logprobs, take new weights."""
