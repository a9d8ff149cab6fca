"""The ground floor: values and buffers every other layer uses (trees, sampling, stats, state, settings)."""
