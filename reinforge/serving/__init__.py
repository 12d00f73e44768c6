"""The policy behind an OpenAI-compatible HTTP endpoint: `reinforge serve`, and agent rollouts in a run."""
