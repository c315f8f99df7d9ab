"""The entry without a line of code: `AUTOWRAPT_BOOTSTRAP=vlmcp_patch` (with autowrapt installed, the
`vlmcp-patch[autowrapt]` extra) makes any Python program of the environment import vlmcp_patch right after its
first `import transformers`, as if its first line were `import vlmcp_patch`.

autowrapt's startup file reads the variable in every interpreter; wrapt then loads this module (the
`[project.entry-points.vlmcp_patch]` entry `transformers`) at startup and registers `on_transformers_import` as a
post-import hook of `transformers`. That is why it lives outside the package and imports nothing: a process that never
imports transformers loads this file and nothing of vlmcp_patch, torch or transformers. Without the variable,
autowrapt loads nothing beyond its own one file and this module is never read.
"""


def on_transformers_import(module) -> None:
    """wrapt's post-import hook of `transformers` (the module, just imported): install vlmcp_patch's patches, exactly
    what `import vlmcp_patch` does (VLMCP_CP_SIZE, VLMCP_DISABLE and the other settings read as there)."""
    import vlmcp_patch  # noqa: F401 - the import applies the patches
