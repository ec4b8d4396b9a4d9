"""Plain functions that read and write files: atomic checkpoint directories, lazy tensor reads."""
