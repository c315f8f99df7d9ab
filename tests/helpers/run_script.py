"""Run a script as `python script.py ARGS` would, then end the process without interpreter finalization.

    python -m tests.helpers.run_script examples/hf_trainer_sft.py ARGS        (under any launcher, with its -m option)

The tests launch the examples through this. A gloo worker thread that drops the last reference to a
tensor while the interpreter shuts down aborts the process ("terminate called without an active
exception", CPython < 3.14) after the script's work is done; exiting without finalization removes that
race from the test suite. The examples themselves end cleanly (barrier, destroy, release) and keep their
atexit handlers, which a user's logging integrations may need.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    from tests.helpers import wrapped_check
    from tests.helpers.harness import dump_stacks_on_signal

    wrapped_check.install()  # every torch.distributed call of the package goes through its wrapper
    dump_stacks_on_signal()  # a hung launched run prints each rank's stacks before it is killed (harness.launch)
    args = sys.argv[1:]
    launcher_args = [a for a in args if a.startswith("--local_rank")]  # the deepspeed launcher puts it first
    script, *script_args = [a for a in args if not a.startswith("--local_rank")]
    sys.argv = [script, *launcher_args, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # what `python script.py` does
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - reported like an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    if (bypassed := wrapped_check.failure()) is not None:
        print(bypassed, file=sys.stderr)
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
