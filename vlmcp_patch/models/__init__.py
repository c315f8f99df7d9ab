"""One module per model family; each declares its patches on top of the shared CP forward in `common`."""

# Top-level classes that run under CP, filled in by the family modules (used in error messages).
SUPPORTED_CLASSES: list[str] = []


def find_supported_model(model):
    """The module of a supported top-level class inside `model` (through PEFT / DeepSpeed / DDP wrappers)."""
    if model is None:
        return None
    for module in model.modules():
        if type(module).__name__ in SUPPORTED_CLASSES:
            return module
    return None
