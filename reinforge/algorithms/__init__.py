"""Algorithms: pure loss and advantage functions, and one readable recipe per algorithm."""
