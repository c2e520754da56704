"""Mixture-of-experts training: the `moe` section (router replay, the
balance-loss coefficients) and the routing metrics (docs/moe.md)."""
