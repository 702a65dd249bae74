"""The bug corpus and `difftest bugs`: real vLLM-Omni bugs re-created in a release, run and judged."""
