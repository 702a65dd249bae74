"""Processes that turn segments into results, each in the environment of the engine it drives."""
