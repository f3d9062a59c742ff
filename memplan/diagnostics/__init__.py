"""Diagnostics beside the search: ``memplan doctor`` (what in a model file or a run costs memory
or time, each finding with its fix) and ``memplan lr-find`` (the learning-rate range test)."""
