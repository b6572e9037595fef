"""Losses: per-token policy losses, their aggregation, value losses, vocab-parallel log-probs.

Import the submodule you need (``megatron_credit.losses.policy``); this package imports nothing so that
the torch-only modules stay free of megatron.
"""
