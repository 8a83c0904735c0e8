"""Checkpoints without pickle: what they hold, saving and restoring on any layout, their files on disk,
exports and the run folder they live in.
"""
