"""`python -m vlmcp_patch [--no-self-test] [--model NAME_OR_PATH [--node-size N]]`: versions, patches, the CP layout of
this launch (with a model: its U x R layout by CP size, on nodes of N ranks), kernels, self-test.

`python -m vlmcp_patch plan --model NAME --tokens N ...`: the cost model's table (`vlmcp_patch.planning`): per CP
size and layout, the predicted per-rank peak memory and step time, before any GPU is booked."""

from __future__ import annotations

import argparse
import sys

from .launcher import launch
from .report import report


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # a subcommand; the report's own flags stay as they were
        from .planning import main as plan_main

        return plan_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m vlmcp_patch", description=__doc__)
    parser.add_argument("--no-self-test", action="store_true", help="skip the ten-second self-test")
    parser.add_argument("--model", help="a checkpoint name or folder (its config only), or tiny-qwen3-vl / "
                        "tiny-qwen3.5: print how its heads split (Ulysses x ring) at each CP size")
    parser.add_argument("--node-size", type=int, default=None, help="ranks (GPUs) per node: show where each P's "
                        "Ulysses subgroups and rings fall on nodes of this size (default: what the launcher "
                        "states when it launched several nodes, else one node)")
    args = parser.parse_args(argv)
    if args.node_size is not None and args.node_size < 1:
        parser.error("--node-size must be a positive number of ranks")
    if args.node_size is None:
        args.node_size = _launched_node_size()
    text, ok = report(run_self_test=not args.no_self_test, text_config=_text_config(args.model), name=args.model,
                      node_size=args.node_size)
    print(text)
    return 0 if ok else 1


def _launched_node_size() -> int | None:
    """Ranks per node of this launch when it spans several nodes (the launcher's node size below WORLD_SIZE), else
    None."""
    here = launch()
    return here.node_size if here.several_nodes else None


def _text_config(name: str | None):
    if name is None:
        return None
    from .fixtures.models import tiny_qwen3_5_config, tiny_qwen3_vl_config

    tiny = {"tiny-qwen3-vl": tiny_qwen3_vl_config, "tiny-qwen3.5": tiny_qwen3_5_config}
    if name in tiny:
        return tiny[name]().get_text_config()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name).get_text_config()


if __name__ == "__main__":
    sys.exit(main())
