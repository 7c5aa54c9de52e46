"""Sequence-parallel attention, collectives and tile kernels."""
