"""The entry without a line of code: `AUTOWRAPT_BOOTSTRAP=vlmcp_patch` (with autowrapt installed, the
`vlmcp-patch[autowrapt]` extra) makes any Python program of the environment import vlmcp_patch right after its
first `import transformers`, as if the line after that import were `import vlmcp_patch`.

autowrapt's startup file reads the variable in every interpreter; wrapt then loads this module (the
`[project.entry-points.vlmcp_patch]` entry `transformers`) at startup and registers `on_transformers_import` as a
post-import hook of `transformers`. That is why it lives outside the package and imports nothing but wrapt (which
autowrapt has loaded already): a process that never imports transformers loads this file and nothing of vlmcp_patch,
torch or transformers. Without the variable, autowrapt loads nothing beyond its own one file and this module is never
read.

Only public import machinery is used: wrapt's post-import hooks. The package defers each optional patch until the
module holding its target has been imported (`patching.PatchSet.on_module_imported`). One case needs this module's
help: transformers is often first imported by such a module itself (`from trl import SFTTrainer` runs TRL's
`sft_trainer`, whose first lines import transformers), so the package arrives while that module's top-level code is
still running, and wrapt cannot report the end of an import that began before a hook was registered. So this module,
loaded before any import of the program, registers a hook on each module holding an optional target
(`OPTIONAL_TARGET_MODULES`, checked against the package's patch records by tests/test_autowrapt.py), which hands the
finished module to the package.
"""

import sys

import wrapt

# The modules that hold the targets of the package's optional patches (`patching.target_module` of each record with
# `requires`).
OPTIONAL_TARGET_MODULES = (
    "accelerate.accelerator", "accelerate.data_loader", "axolotl.loaders.model",
    "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
    "flash_attn", "flash_attn.flash_attn_interface",
    "swift.dataloader.dispatcher", "swift.dataloader.shard", "swift.sequence_parallel.sequence_parallel",
    "torch.utils.data.distributed", "transformers.trainer",
    "trl.generation.vllm_generation", "trl.trainer.dpo_trainer", "trl.trainer.grpo_config", "trl.trainer.grpo_trainer",
    "trl.trainer.kto_trainer", "trl.trainer.rloo_config", "trl.trainer.rloo_trainer", "trl.trainer.sft_trainer",
)


def on_transformers_import(module) -> None:
    """wrapt's post-import hook of `transformers` (the module, just imported): install vlmcp_patch's patches, exactly
    what `import vlmcp_patch` does (VLMCP_CP_SIZE, VLMCP_DISABLE and the other settings read as there)."""
    import vlmcp_patch  # noqa: F401 - the import applies the patches


def on_target_import(module) -> None:
    """wrapt's post-import hook of a module of `OPTIONAL_TARGET_MODULES`, registered at startup: where the package
    has arrived, it installs the patches of that module now that its import has ended (a no-op when it has
    already; where the package has not arrived, it installs them when it does)."""
    patching = sys.modules.get("vlmcp_patch.patching")
    if patching is not None:
        patching.PATCHES.on_module_imported(module)


for _name in OPTIONAL_TARGET_MODULES:
    wrapt.register_post_import_hook(on_target_import, _name)
