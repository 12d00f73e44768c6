"""Evaluation on public benchmarks: pass@k, maj@k and accuracy of n samples per prompt."""
