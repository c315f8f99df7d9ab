"""Text attention layers whose `forward` a script replaced with a function of its own.

Under CP a decoder layer's attention holds this rank's slice of the row. The stock forward reaches the attention
registry, whose wrappers exchange sequence for heads (`ulysses.py`). A script's own forward (the official Qwen3-VL
fine-tuning script's packed mode) may instead call flash-attn's entry points itself, which the package wraps
(`flash.py`). Those wrappers cannot see the CP context the decoder hands each layer (`vlmcp_ctx`, a keyword the
script's forward receives but does not pass on), so the text attention modules whose forward is foreign carry it:
hooks around each call make it current (`attention_context`) for the duration — gradient-checkpointing
recomputation calls the module again, and the hooks again.

A foreign forward is checked before any compute (`foreign_attention_problem`): it must reach one of the two paths
— the attention registry (or the stock forward, through `super()`), or flash-attn's entry points as the package
wrapped them. One that reaches none would compute attention within the rank's slice, silently
wrong: it is refused, by name, on every rank. After each call, a foreign forward that exchanged nothing raises too
(the check reads code, this reads what ran).
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass

from ..context import CTX_KWARG, CPContext
from ..errors import UnsupportedSetupError
from ..flags import scoped

# The package's own attention path is calling a kernel on the whole sequence: flash-attn's wrappers pass through.
_KERNEL = contextvars.ContextVar("vlmcp_kernel_on_whole_sequence", default=False)


@dataclass
class _Call:
    """A foreign text attention module's call under CP: its context, and whether it exchanged sequence for heads."""

    ctx: CPContext
    exchanged: bool = False


_RUNNING: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("vlmcp_foreign_attention", default=None)


def attention_context() -> CPContext | None:
    """The CP context of the foreign text attention running now, when a kernel call inside it needs the exchange
    (P > 1, not the package's own attention path); else None."""
    call = _RUNNING.get()
    if call is None or _KERNEL.get() or call.ctx.cp.size == 1:
        return None
    return call.ctx


def kernel_on_whole_sequence():
    """Inside the block the package calls a kernel on the whole sequence already."""
    return scoped(_KERNEL, True)


def record_exchange(ctx: CPContext) -> None:
    """The running attention exchanged sequence for heads (the check after each foreign call reads it)."""
    call = _RUNNING.get()
    if call is not None and call.ctx is ctx:
        call.exchanged = True


# ---------------------------------------------------------------------------------------------------------
# Which forwards are foreign, and whether they reach a path that exchanges


def text_attention_modules(model) -> list:
    """The softmax attention modules of the text decoder layers of `model` (any wrapper around it)."""
    return [module for module in model.modules() if type(module).__name__.endswith("Attention")
            and getattr(module, "is_causal", False) and hasattr(module, "q_proj")]


def foreign_forward(module):
    """The module's `forward` when it is not transformers' own (a script replaced it, or a subclass overrides it)."""
    forward = type(module).forward
    forward = getattr(forward, "vlmcp_original", forward)
    return None if (getattr(forward, "__module__", None) or "").startswith("transformers.") else forward


def _referenced(function) -> list:
    """Everything `function` refers to by name — globals, module attributes, closure cells — and, through the
    functions among them that are not transformers' or torch's, everything those refer to."""
    found, seen, todo = [], set(), [function]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        names, codes = set(), [fn.__code__]
        while codes:
            code = codes.pop()
            names.update(code.co_names)
            codes += [c for c in code.co_consts if hasattr(c, "co_names")]
        scope = getattr(fn, "__globals__", {})
        here = [scope[name] for name in names if name in scope]
        here += [getattr(obj, name) for obj in list(here) for name in names if hasattr(obj, name)]
        here += [cell.cell_contents for cell in (fn.__closure__ or ()) if _filled(cell)]
        found += here + (["super"] if "super" in names else [])
        todo += [obj for obj in here if inspect.isfunction(obj) and not obj.__module__.startswith(("transformers.",
                                                                                                    "torch"))]
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _reaches_an_exchange(function) -> str | None:
    """None when `function` reaches the registry, the stock forward (`super()`) or the wrapped flash-attn entry
    points; else what it lacks."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    unwrapped = []
    for obj in _referenced(function):
        if obj == "super" or obj is ALL_ATTENTION_FUNCTIONS:  # a subclass's forward through the stock one
            return None
        name = getattr(obj, "__name__", "")
        if name in ("flash_attn_varlen_func", "flash_attn_func"):
            if getattr(obj, "vlmcp_original", None) is not None:
                return None
            unwrapped.append(f"{getattr(obj, '__module__', '?')}.{name}")
    if unwrapped:
        return (f"it calls {', '.join(unwrapped)} as bound before `import vlmcp_patch` (not the package's wrapper): "
                "import vlmcp_patch before flash_attn in that script")
    return "it calls neither transformers' attention functions nor flash-attn's entry points"


def foreign_attention_problem(model) -> str | None:
    """Why a foreign text attention forward of `model` cannot run under CP, or None."""
    for module in text_attention_modules(model):
        function = foreign_forward(module)
        if function is None:
            continue
        lacking = _reaches_an_exchange(function)
        if lacking:
            return (f"{type(module).__name__}.forward is replaced by {function.__module__}.{function.__qualname__}, "
                    f"which would compute attention within each rank's slice under CP: {lacking}")
    return None


# ---------------------------------------------------------------------------------------------------------
# The hooks that carry the context into a foreign forward


def _enter(module, args, kwargs):
    ctx = kwargs.get(CTX_KWARG)
    module._vlmcp_tokens.append(_RUNNING.set(_Call(ctx)) if ctx is not None else None)


def _leave(module, args, kwargs, output):
    token = module._vlmcp_tokens.pop()
    if token is None:
        return
    call = _RUNNING.get()
    _RUNNING.reset(token)
    if output is not None and call.ctx.cp.size > 1 and not call.exchanged:  # None: the forward raised
        function = foreign_forward(module)
        raise UnsupportedSetupError(
            f"{type(module).__name__}.forward, replaced by {function.__module__}.{function.__qualname__}, ran under CP "
            "without exchanging sequence for heads: its attention covered this rank's slice only"
        )


def carry_context_into_foreign_attention(model) -> bool:
    """Hook every text attention module of `model` whose forward is foreign (once per module); whether any is."""
    foreign = [module for module in text_attention_modules(model) if foreign_forward(module) is not None]
    for module in foreign:
        if not hasattr(module, "_vlmcp_tokens"):
            module._vlmcp_tokens = []
            module.register_forward_pre_hook(_enter, with_kwargs=True)
            module.register_forward_hook(_leave, with_kwargs=True, always_call=True)
    return bool(foreign)
