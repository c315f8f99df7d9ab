"""One module per model family; each declares its patches on top of the shared CP forward in `common`."""

# Top-level classes that run under CP, filled in by the family modules (used in error messages).
SUPPORTED_CLASSES: list[str] = []
