"""Baseline placement policies for the benchmarks, written from their published descriptions.

static EP (`static`), DeepSeek EPLB (`eplb`), CRAFT (`craft`) and the hindsight reference (`hindsight`).
Each turns load totals into full RoutingTables; the benchmark decides when each is installed.
"""
