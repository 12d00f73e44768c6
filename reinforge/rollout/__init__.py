"""Turning prompts into scored trajectories."""
