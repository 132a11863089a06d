"""Precision tools: what ran in which dtype (explain), and the first op that overflows (find_overflow)."""
