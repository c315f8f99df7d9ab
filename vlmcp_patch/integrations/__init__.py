"""Patches for the training stacks that drive the models: Accelerate (HF Trainer, TRL), DeepSpeed, TRL."""
