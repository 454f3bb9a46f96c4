"""decoding layer."""
