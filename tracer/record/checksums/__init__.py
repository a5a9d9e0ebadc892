"""Checksums (exact MD5, on-device fingerprints) and stats of the tensors a trace records."""
