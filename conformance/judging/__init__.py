"""Judging: how far a tensor is from what it is checked against, the limits it is held to, and the verdict."""
