"""Scaling out: the reference side on a Ray cluster (`difftest run --ray`). Ray is imported only here."""
