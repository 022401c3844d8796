"""The checkpoint format every weight producer and consumer shares: manifests, fetching, deltas and the
delta kernels."""
