"""Running: a run's configuration, the truth of each case, backend calls under a guard, the suite's own time."""
