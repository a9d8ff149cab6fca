"""The ground floor: contracts (rows, requests, runtimes, settings, constraint, the pool contract)
and the values and buffers every other layer uses (trees, sampling, stats, state); no method's own
data structure (those sit beside their drafters, in :mod:`hasten.drafters`)."""
