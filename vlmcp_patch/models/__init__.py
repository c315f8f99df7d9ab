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


def batch_reference(call: dict):
    """The tensor that fixes a forward's batch shape and device: `input_ids`, else `inputs_embeds` (or None)."""
    return call["input_ids"] if call.get("input_ids") is not None else call.get("inputs_embeds")


def batch_device(call: dict):
    """Where a forward's batch lives: small control tensors for collectives go there (NCCL takes no CPU ones)."""
    import torch

    reference = batch_reference(call)
    return reference.device if reference is not None else torch.device("cpu")
