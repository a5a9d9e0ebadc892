"""Optional features that follow the recorder: memory records, distributed runs, scoped logs,
NaN guards and size bounds."""
